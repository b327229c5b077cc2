"""Building the Serve application of omnistage replicas, and running it: `omnistage serve --ray` (which starts
Ray on the machine, or joins `--ray-address`'s cluster) or Serve's own `serve run omnistage.ray:app_builder`.

Routing (omnistage/ray/routing.py): a request naming a session goes to the replica that holds it; any other to
the less loaded of two replicas drawn at random (requests in flight), which is least-outstanding-requests in
effect. Scaling is Serve's autoscaler on the requests in flight per replica.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve
from ray.serve import Application

from omnistage.config import EngineConfig
from omnistage.errors import ConfigError
from omnistage.ray.deployment import OmnistageReplica
from omnistage.ray.metrics import BOARD_NAME, MetricsBoard
from omnistage.ray.routing import router_config
from omnistage.server.options import ServerOptions

APP_NAME = "omnistage"
# Requests one replica takes at once before Serve queues them for another: the engine batches up to its
# max_batch and queues the rest itself, so the cap is well above any batch (Serve's default is 5).
MAX_ONGOING_REQUESTS = 1024
log = logging.getLogger("omnistage.serve")


@dataclass(frozen=True)
class Scaling:
    """How many replicas, and what each takes of the cluster."""

    replicas: int = 1
    autoscale: tuple[int, int] | None = None  # (min, max) replicas: Serve's autoscaler between them
    target_ongoing_requests: float = 16.0
    gpus: float = 0.0  # per replica; a fraction shares a card
    cpus: float = 1.0
    # Serve's autoscaler waits this long on a load before it adds (removes) a replica
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    # and judges the load by the replicas' reports averaged over this long (Serve's default)
    look_back_period_s: float = 30.0

    @classmethod
    def of(cls, args: argparse.Namespace, config: EngineConfig) -> Scaling:
        """The flags' scaling, checked; raises ConfigError naming the flag at fault."""
        if args.replicas < 1:
            raise ConfigError(f"--replicas {args.replicas}: must be at least 1")
        autoscale = None
        if args.autoscale is not None:
            low, _, high = args.autoscale.partition(":")
            if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
                raise ConfigError(f"--autoscale {args.autoscale}: give MIN:MAX replicas, 1 <= MIN <= MAX")
            autoscale = (int(low), int(high))
        if args.target_ongoing_requests <= 0:
            raise ConfigError(f"--target-ongoing-requests {args.target_ongoing_requests}: must be above 0")
        gpus = args.replica_gpus if args.replica_gpus is not None else _gpus_of(config)
        if gpus < 0 or args.replica_cpus < 0:
            raise ConfigError("--replica-gpus and --replica-cpus must be at least 0")
        return cls(args.replicas, autoscale, args.target_ongoing_requests, gpus, args.replica_cpus)

    def deployment_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "max_ongoing_requests": MAX_ONGOING_REQUESTS,
            "ray_actor_options": {"num_cpus": self.cpus, "num_gpus": self.gpus},
            **router_config(),
        }
        if self.autoscale is None:
            options["num_replicas"] = self.replicas
        else:
            options["autoscaling_config"] = {
                "min_replicas": self.autoscale[0],
                "max_replicas": self.autoscale[1],
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
                "look_back_period_s": self.look_back_period_s,
            }
        return options


def _gpus_of(config: EngineConfig) -> float:
    """The GPUs one replica's topology names (0 on a CPU); "auto" is a GPU where this machine has one."""
    devices = {
        config.device_of(stage)[0]
        for stage in ("thinker", "encoders", "talker", "code_predictor", "code2wav")
    }
    if "auto" in devices:
        import torch

        devices = {("cuda" if torch.cuda.is_available() else "cpu") if d == "auto" else d for d in devices}
    return float(len({"cuda:0" if d == "cuda" else d for d in devices if d.startswith("cuda")}))


def replica_app(config: EngineConfig, options: ServerOptions, scaling: Scaling = Scaling()) -> Application:
    """The Serve application: `scaling`'s replicas of the server `config` and `options` describe. The board the
    replicas' metrics meet on is made (or found) here, in the cluster the caller is connected to."""
    ray.remote(num_cpus=0)(MetricsBoard).options(  # type: ignore[attr-defined]
        name=BOARD_NAME, get_if_exists=True, lifetime="detached"
    ).remote()
    deployment = serve.deployment(name="omnistage", **scaling.deployment_options())(OmnistageReplica)
    return deployment.bind(config, options)


def serve_on_ray(args: argparse.Namespace, config: EngineConfig, options: ServerOptions) -> None:
    """`omnistage serve --ray`: Ray started here (or the cluster at --ray-address joined), the replicas started,
    and the endpoint served at --host:--port until interrupted."""
    scaling = Scaling.of(args, config)
    ray.init(address=args.ray_address, namespace=APP_NAME)
    serve.start(http_options={"host": args.host, "port": args.port})
    log.info(
        "serving '%s' at http://%s:%d/v1 on Ray Serve: %s, %g GPU(s) and %g CPU(s) each",
        options.served_model_name,
        args.host,
        args.port,
        f"{scaling.replicas} replica(s)"
        if scaling.autoscale is None
        else "{} to {} replicas".format(*scaling.autoscale),
        scaling.gpus,
        scaling.cpus,
    )
    serve.run(replica_app(config, options, scaling), name=APP_NAME, route_prefix="/", blocking=True)


def app_builder(args: dict[str, str]) -> Application:
    """For `serve run omnistage.ray:app_builder key=value ...` and a KubeRay RayService (deploy/): the keys are
    `omnistage serve`'s flags without their dashes (`model=/models/Qwen3-ASR-0.6B replicas=2
    replica_gpus=0.25`; `true` for a switch)."""
    return replica_app(*app_settings(args))


def app_settings(args: dict[str, str]) -> tuple[EngineConfig, ServerOptions, Scaling]:
    """`app_builder`'s keys read as the serve command reads its flags, each checked the same way."""
    from omnistage.cli.engine_flags import engine_config_of
    from omnistage.cli.parser import build_parser
    from omnistage.cli.serve import server_options

    argv = ["serve", "--ray"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if str(value).lower() == "true" else [flag, str(value)]
    parsed = build_parser().parse_args(argv)
    config = engine_config_of(parsed)
    return config, server_options(parsed, config), Scaling.of(parsed, config)
