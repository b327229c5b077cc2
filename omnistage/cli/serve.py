"""`omnistage serve`: the HTTP server over a pipeline, on a socket bound before the model loads."""

from __future__ import annotations

import argparse
import errno
import logging
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from omnistage.cli.engine_flags import engine_config_of
from omnistage.errors import ConfigError

if TYPE_CHECKING:
    from omnistage.config import EngineConfig
    from omnistage.models.qwen3_omni.video_decoding import VideoLimits
    from omnistage.server.options import ServerOptions


def run(args: argparse.Namespace) -> None:
    config = engine_config_of(args)
    options = server_options(args, config)
    if args.ray:
        from omnistage.ray.launch import serve_on_ray

        serve_on_ray(args, config, options)
        return
    listener = bind(args.host, args.port)
    try:
        _load_and_serve(args, config, options, listener)
    finally:
        listener.close()


def server_options(args: argparse.Namespace, config: EngineConfig) -> ServerOptions:
    """The server's settings from the flags, each checked; raises ConfigError naming the flag at fault."""
    from omnistage.media import VIDEO_CACHE_MIB, DecodedVideos, MediaPolicy
    from omnistage.models.qwen3_omni.video_decoding import VideoLimits
    from omnistage.server.options import ServerOptions
    from omnistage.server.realtime.route import RealtimeLimits

    media_dir = Path(args.media_dir).resolve() if args.media_dir else None
    if media_dir is not None and not media_dir.is_dir():
        raise ConfigError(f"--media-dir {args.media_dir}: not a directory")
    _check(args, "header_timeout", above=0, unit=" seconds")
    _check(args, "max_connections", at_least=1)
    for kept in (
        "spoken_answers_retention_s",
        "max_spoken_answers",
        "responses_retention_s",
        "max_stored_responses",
    ):
        _check(args, kept, at_least=0)
    _check(args, "max_sessions", at_least=1)
    _check(args, "video_cache_mib", at_least=0)
    _check(args, "realtime_idle_timeout_s", above=0, unit=" seconds")
    _check(args, "realtime_max_conversation_tokens", at_least=1)
    video = video_limits(args, VideoLimits())
    realtime = RealtimeLimits(
        args.max_sessions, args.realtime_idle_timeout_s, args.realtime_max_conversation_tokens
    )
    return ServerOptions(
        served_model_name=args.served_model_name
        or (Path(config.model).resolve().name if config.model else "omnistage-tiny"),
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        media=MediaPolicy(
            allow_remote=args.allow_remote_media,
            media_dir=media_dir,
            video=video,
            decoded_videos=DecodedVideos(
                (VIDEO_CACHE_MIB if args.video_cache_mib is None else args.video_cache_mib) << 20
            ),
        ),
        spoken_answers_retention_s=args.spoken_answers_retention_s,
        max_spoken_answers=args.max_spoken_answers,
        responses_retention_s=args.responses_retention_s,
        max_stored_responses=args.max_stored_responses,
        playground=args.playground,
        engine_process=args.engine_process,
        realtime=realtime,
    )


def video_limits(args: argparse.Namespace, default: VideoLimits) -> VideoLimits:
    """The video bounds the flags set, the rest at `default`'s; a stream may hold 60 frames a second."""
    from dataclasses import replace

    limits = default
    _check(args, "max_video_seconds", above=0)
    _check(args, "max_video_frames", at_least=1)
    _check(args, "max_video_frame_pixels", at_least=1)
    if args.max_video_seconds is not None:
        stream_frames = int(args.max_video_seconds * 60)
        limits = replace(limits, max_seconds=args.max_video_seconds, max_stream_frames=stream_frames)
    if args.max_video_frames is not None:
        limits = replace(limits, max_frames=args.max_video_frames)
    if args.max_video_frame_pixels is not None:
        limits = replace(limits, max_frame_pixels=args.max_video_frame_pixels)
    return limits


def _check(
    args: argparse.Namespace,
    name: str,
    *,
    at_least: int | None = None,
    above: int | None = None,
    unit: str = "",
) -> None:
    """Raise ConfigError naming the flag of `args.<name>` where it is given and below its bound."""
    value, flag = getattr(args, name), "--" + name.replace("_", "-")
    if value is None:
        return
    if at_least is not None and value < at_least:
        raise ConfigError(f"{flag} {value}: must be at least {at_least}{unit}")
    if above is not None and value <= above:
        raise ConfigError(f"{flag} {value}: must be above {above}{unit}")


def _load_and_serve(
    args: argparse.Namespace, config: EngineConfig, options: ServerOptions, listener: socket.socket
) -> None:
    import uvicorn

    from omnistage.server.http_protocol import with_header_timeout
    from omnistage.server.options import load_server

    pipeline, app = load_server(config, options)
    try:
        url = f"http://{args.host}:{listener.getsockname()[1]}"
        logging.getLogger("omnistage.serve").info(
            "serving '%s' at %s/v1 (API key %s, max queue %s, max %d connections, header timeout %g s)\n  "
            "%s\n  %s",
            options.served_model_name,
            url,
            "required" if args.api_key else "off",
            args.max_queue if args.max_queue is not None else "unbounded",
            args.max_connections,
            args.header_timeout,
            f"the playground: {url}/" if args.playground else "the playground: off (--no-playground)",
            pipeline.memory_summary(),
        )
        http_config = uvicorn.Config(
            app,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
            http=with_header_timeout(args.header_timeout),
            # uvicorn answers 503 once its open connections (the asking one among them) or running requests
            # reach the limit: N + 1 serves N connections.
            limit_concurrency=args.max_connections + 1,
        )
        server = uvicorn.Server(http_config)
        server.run(sockets=[listener])
    finally:
        pipeline.shutdown()


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a busy port fails at once, not after minutes of
    loading, and nothing can take the port while the model loads (asyncio starts listening on it)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    # A restarted server may bind while its predecessor's connections linger in TIME_WAIT, as uvicorn does.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {port} is in use on {host}; stop what holds it or choose another --port"
            ) from None
        raise ConfigError(f"cannot bind {host}:{port}: {exc.strerror}") from None
    return sock
