"""A CPU install without Triton imports omnistage, serves and generates: GPU kernels load only on a GPU."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import importlib.abc
    import sys


    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.partition(".")[0] == "triton":
                raise ImportError(f"No module named {name!r} (Triton is not installed)")
            return None


    sys.meta_path.insert(0, NoTriton())

    from fastapi.testclient import TestClient

    from omnistage import LLM, SamplingParams
    from omnistage.config import engine_config
    from omnistage.pipeline.async_pipeline import AsyncPipeline
    from omnistage.server import build_app

    checkpoint = sys.argv[1]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    out = LLM(model=checkpoint, device="cpu", num_kv_pages=64).generate("Hello", params)[0]
    assert len(out.outputs[0].token_ids) == 4, out

    engine = AsyncPipeline.from_config(engine_config(model=checkpoint, device="cpu", num_kv_pages=64))
    try:
        with TestClient(build_app(engine, "tiny")) as client:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
            response = client.post("/v1/chat/completions", json=body)
    finally:
        engine.shutdown()
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4, response.text
    assert not any(name.partition(".")[0] == "triton" for name in sys.modules)
    print("ok")
    """
)


def test_import_serve_and_generate_without_triton(tiny_checkpoint):
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_checkpoint)], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
