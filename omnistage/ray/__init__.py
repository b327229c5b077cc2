"""omnistage on Ray Serve: replicas of the whole server, each one pipeline on the GPUs it is given, behind one
endpoint (`omnistage serve --ray`, or `serve run omnistage.ray:app_builder model=DIR replicas=2`).

Ray is an optional dependency (`pip install 'omnistage[ray]'`): only this package imports it, and nothing
outside it imports this package but the serve command when asked for `--ray`.
"""

from omnistage.ray.launch import app_builder, replica_app

__all__ = ["app_builder", "replica_app"]
