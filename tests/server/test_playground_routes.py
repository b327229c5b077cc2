"""The playground's routes, in-process on a fake pipeline: served without the API key, off with
`playground=False` (`omnistage serve --no-playground`), and every file the page loads (its modules, and the
microphone's audio worklet) is served."""

from __future__ import annotations

import re
from importlib.resources import files

import pytest
from fastapi.testclient import TestClient

from omnistage.cli import build_parser
from omnistage.server import build_app

FOLDER = files("omnistage.server").joinpath("playground")


def test_the_page_and_its_files_need_no_key(fake_pipeline):
    client = TestClient(build_app(fake_pipeline, "m", api_key="k"))
    for path in ("/", "/playground"):
        page = client.get(path)
        assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
        assert page.text == FOLDER.joinpath("index.html").read_text()
    # what the page loads, and what each of its modules imports, is served
    wanted = set(re.findall(r'(?:src|href)="/playground/([^"]+)"', page.text))
    for script in FOLDER.iterdir():
        if script.name.endswith(".js"):
            wanted |= set(re.findall(r'from "\./([^"]+)"', script.read_text()))
            wanted |= set(re.findall(r'addModule\("/playground/([^"]+)"\)', script.read_text()))
    assert {"app.js", "api.js", "style.css"} <= wanted
    for name in wanted:
        response = client.get(f"/playground/{name}")
        assert response.status_code == 200, name
        assert response.content == FOLDER.joinpath(name).read_bytes()
        kind = "text/javascript" if name.endswith(".js") else "text/css"
        assert response.headers["content-type"] == f"{kind}; charset=utf-8"
    # every file in the folder is served: none is packaged for nothing
    assert {f.name for f in FOLDER.iterdir()} == wanted | {"index.html"}
    assert client.get("/v1/models").status_code == 401  # the API itself still asks for the key


@pytest.mark.parametrize("path", ["/playground/nope.js", "/playground/index.html", "/playground/%2e%2e"])
def test_no_other_file(fake_pipeline, path):
    response = TestClient(build_app(fake_pipeline, "m")).get(path)
    assert response.status_code == 404
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_trailing_slash_goes_to_the_page(fake_pipeline):
    response = TestClient(build_app(fake_pipeline, "m")).get("/playground/", follow_redirects=False)
    assert response.status_code == 307 and response.headers["location"].endswith("/playground")


def test_no_playground(fake_pipeline):
    assert build_parser().parse_args(["serve", "--no-playground"]).playground is False
    assert build_parser().parse_args(["serve"]).playground is True
    client = TestClient(build_app(fake_pipeline, "m", playground=False))
    for path in ("/", "/playground", "/playground/app.js"):
        response = client.get(path)
        assert response.status_code == 404, path
        assert response.json()["error"]["message"] == "Not Found"
    assert client.get("/v1/models").status_code == 200
