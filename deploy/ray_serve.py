"""python -m deploy.ray_serve: Tern's app on Ray Serve, N engine replicas behind Ray's HTTP proxy.

    python -m deploy.ray_serve --replicas 2 --num-cpus 1            # this machine (starts a local Ray)
    ray start --head; python -m deploy.ray_serve --ray-address auto  # join a running cluster
    python -m deploy.ray_serve --model A --model B --replicas 2     # several models (or --models models.yaml)

Every flag of `python app.py` works here too (--model, --models, --quantization, --api-key, --max-waiting, ...), each
replica serving as one `python app.py` would. The app: TernIngress (reads each request, picks its model, tokenizes its
prompt to route it) -> TernReplica x N (one engine each) chosen by deploy/router.py, plus TernBoard (metrics and
drain). Several models: one replica deployment per model (TernReplica-<id>), N replicas each, each replica serving its
model alone; the ingress sends a request to the replicas of the model its body names.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tern.settings import Flag, SettingsError, add_flags
from tern.settings import parse_args as parse_tern_args

ROOT = Path(__file__).resolve().parent.parent
APP_NAME = "tern"
UI_HEADROOM = 8  # ongoing requests a replica takes beyond its engine's queue: UI streams, probes, /v1/models
MAX_QUEUED_REQUESTS = 1024  # per ingress replica, waiting for a replica with room
DEFAULT_OBJECT_STORE_BYTES = 256 * 1024 * 1024  # a local cluster's; replicas pass only requests and tokens through it
ROUTERS = ("prefix", "pow2")

logger = logging.getLogger("tern.ray")


@dataclass(frozen=True)
class ScaleSettings:
    replicas: int = 2
    num_cpus: float = 1.0  # per replica
    num_gpus: float = 0.0  # per replica
    min_replicas: int | None = None  # with max_replicas: autoscaling
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0
    ingress_replicas: int = 1
    router: str = "prefix"  # deploy/router.py; "pow2": Ray's default power-of-two-choices
    imbalanced_threshold: int = 4  # deploy/router.py: beyond this difference in queue lengths, load wins
    ray_address: str | None = None  # None: join a running cluster if there is one, else start a local one
    object_store_memory_bytes: int = DEFAULT_OBJECT_STORE_BYTES

    @property
    def is_autoscaling(self) -> bool:
        return self.max_replicas is not None

    @property
    def threads_per_replica(self) -> int:
        return max(1, int(self.num_cpus))


SCALE_FLAGS = (
    Flag("replicas", "replicas", "TERN_REPLICAS", "engine replicas, each with its own engine and KV cache", type=int),
    Flag("num-cpus", "num_cpus", "TERN_REPLICA_CPUS", "CPUs Ray reserves per replica, fractions allowed; its torch "
         "threads are this, at least 1", type=float),
    Flag("num-gpus", "num_gpus", "TERN_REPLICA_GPUS", "GPUs per replica, fractions allowed; pass --device cuda too",
         type=float),
    Flag("min-replicas", "min_replicas", None, "autoscaling: the fewest replicas; unset: 1", type=int),
    Flag("max-replicas", "max_replicas", None, "autoscaling on: Ray adds replicas up to this while requests queue",
         type=int),
    Flag("target-ongoing-requests", "target_ongoing_requests", None, "autoscaling: the requests per replica Ray aims at",
         type=float),
    Flag("ingress-replicas", "ingress_replicas", None, "replicas of the ingress", type=int),
    Flag("router", "router", None, "prefix: to the replica holding the prompt's prefix unless load is imbalanced; "
         "pow2: Ray's default power-of-two-choices", choices=ROUTERS),
    Flag("imbalanced-threshold", "imbalanced_threshold", None, "prefix router: load wins once queue lengths differ by "
         "more than this", type=int),
    Flag("ray-address", "ray_address", "RAY_ADDRESS", "a running cluster's address (auto: the one on this node); "
         "local: always start a new one; unset: join a running cluster if there is one, else start a local one"),
    Flag("object-store-memory", "object_store_memory_bytes", None, "a local cluster's object store", type=int,
         metavar="BYTES"),
)


def parse_args(argv: list[str] | None = None):
    """(ServerSettings, the models (ModelSpecs, the default first), ScaleSettings): the Ray flags here, the rest as
    `python app.py` reads them."""
    parser = argparse.ArgumentParser(
        prog="python -m deploy.ray_serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every flag of `python app.py --help` is accepted too.",
    )
    add_flags(parser, SCALE_FLAGS, ScaleSettings())
    args, rest = parser.parse_known_args(argv)
    try:
        server, specs, _ = parse_tern_args(rest)
    except SettingsError as exc:
        parser.error(str(exc))
    if args.max_replicas is None and args.min_replicas is not None:
        parser.error("--min-replicas needs --max-replicas (autoscaling)")
    return server, specs, ScaleSettings(**{flag.field: getattr(args, flag.field) for flag in SCALE_FLAGS})


def replica_deployment_names(model_ids: list[str]) -> list[str]:
    """One model: TernReplica, as ever. Several: TernReplica-<id>, each id in the characters Ray allows in a name."""
    if len(model_ids) == 1:
        return ["TernReplica"]
    names: list[str] = []
    for model_id in model_ids:
        name = "TernReplica-" + re.sub(r"[^A-Za-z0-9_.-]", "_", model_id)
        names.append(name if name not in names else f"{name}-{len(names) + 1}")
    return names


def build_app(server, models, scale: ScaleSettings):
    """The Serve application: ingress -> each model's replicas (chosen among them by the router), and the board.
    `models`: parse_args' ModelSpecs, the default model first."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from deploy.board import TernBoard
    from deploy.ingress import TernIngress
    from deploy.router import PrefixAwareRouter

    if scale.router == "prefix":
        router = RequestRouterConfig(
            request_router_class=PrefixAwareRouter,
            request_router_kwargs={"imbalanced_threshold": scale.imbalanced_threshold},
            request_routing_stats_period_s=0.5, request_routing_stats_timeout_s=5.0,
        )
    else:
        router = RequestRouterConfig()
    size = ({"autoscaling_config": {"min_replicas": scale.min_replicas or 1, "max_replicas": scale.max_replicas,
                                    "target_ongoing_requests": scale.target_ongoing_requests}}
            if scale.is_autoscaling else {"num_replicas": scale.replicas})
    board = serve.deployment(TernBoard, name="TernBoard", num_replicas=1, max_ongoing_requests=1000,
                             ray_actor_options={"num_cpus": 0},
                             logging_config={"enable_access_log": False}).bind()  # a report a second per replica
    replicas = [_replicas(name, spec, server, board, router, size, scale)
                for name, spec in zip(replica_deployment_names([spec.id for spec in models]), models)]
    return serve.deployment(TernIngress, name="TernIngress").options(
        num_replicas=scale.ingress_replicas, max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=server.drain_timeout_s + 20,
    ).bind(replicas[0], board, server, models, other_replicas=dict(zip([s.id for s in models[1:]], replicas[1:])))


def _replicas(name: str, spec, server, board, router, size: dict, scale: ScaleSettings):
    """One model's replica deployment; each replica serves that model alone, under its id, loaded for good (the
    registry's --keep-alive and --max-loaded are for one process holding several models)."""
    from ray import serve

    from deploy.replica import TernReplica
    from tern.allocator_env import allocator_env

    engine_config = spec.config
    return serve.deployment(TernReplica, name=name).options(
        **size,
        ray_actor_options={
            "num_cpus": scale.num_cpus, "num_gpus": scale.num_gpus,
            # Read by libgomp and torch's allocator when the process starts, before the replica's code can act.
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(scale.threads_per_replica), **allocator_env()}},
        },
        # Tern's own 429 (--max-waiting) is the limit a client meets: a replica holds its engine's running and
        # waiting requests, and refuses the next at once. Ray's queue in front of the replicas absorbs bursts: every
        # request waits in it for a moment while Ray picks a replica, so a small bound would refuse a page's dozen
        # asset requests; past MAX_QUEUED_REQUESTS the ingress answers 429 too.
        max_ongoing_requests=engine_config.max_num_seqs + engine_config.max_waiting + UI_HEADROOM,
        max_queued_requests=MAX_QUEUED_REQUESTS,
        graceful_shutdown_timeout_s=server.drain_timeout_s + 15, graceful_shutdown_wait_loop_s=1.0,
        health_check_period_s=5.0, health_check_timeout_s=30.0,
        request_router_config=router,
        logging_config={"enable_access_log": False},  # each replica's app logs its requests itself
    ).bind(replace(server, served_model_name=spec.id), engine_config, board, scale.threads_per_replica)


def app_builder(args: dict):
    """For a Serve config file (KubeRay's serveConfigV2, `serve deploy`): `import_path: deploy.ray_serve:app_builder`
    with `args: {flags: "--replicas 2 --num-cpus 1 ..."}`, the same flags as this command's."""
    import shlex

    server, models, scale = parse_args(shlex.split(args.get("flags", "")))
    return build_app(server, models, scale)


def connect(scale: ScaleSettings) -> bool:
    """Join the cluster, or start a local one; True if this process started it (and so stops it)."""
    import ray

    # Replicas import Tern's modules from this checkout; on a cluster every node needs it at the same path (the
    # container image has it at /home/user/app).
    runtime_env = {"env_vars": {"PYTHONPATH": str(ROOT)}}
    local = dict(include_dashboard=False, object_store_memory=scale.object_store_memory_bytes, runtime_env=runtime_env)
    if scale.ray_address == "local":
        ray.init(**local)
        return True
    if scale.ray_address:
        ray.init(address=scale.ray_address, runtime_env=runtime_env)
        return False
    try:
        ray.init(address="auto", runtime_env=runtime_env)
        return False
    except ConnectionError:
        ray.init(**local)
        return True


def run(server, models, scale: ScaleSettings) -> None:
    """Deploy and serve until SIGTERM/SIGINT, then drain (as `python app.py` does) and remove the app."""
    import ray
    from ray import serve

    started_ray = connect(scale)
    logger.info("Ray cluster at %s (%s)", ray.get_runtime_context().gcs_address,
                "started here" if started_ray else "joined")
    signals = _Signals()
    try:
        serve.start(http_options={"host": server.host, "port": server.port})
        serve.run(build_app(server, models, scale), name=APP_NAME, route_prefix="/")
        logger.info("serving %s on http://%s:%d with %s%s", ", ".join(f"`{spec.id}`" for spec in models), server.host,
                    server.port, f"{scale.min_replicas or 1}-{scale.max_replicas} replicas" if scale.is_autoscaling
                    else f"{scale.replicas} replicas", " per model" if len(models) > 1 else "")
        signals.first.wait()
        drain(server.drain_timeout_s, signals.second)
        serve.delete(APP_NAME)
    finally:
        if started_ray:
            serve.shutdown()
            ray.shutdown()


def drain(timeout_s: float, cut_short: threading.Event) -> None:
    """Every replica stops taking requests (503) and its running ones get timeout_s to finish, then are ended
    (finish_reason "abort"); returns once no replica has requests."""
    from ray import serve

    from deploy.board import REPORT_PERIOD_S

    ingress = serve.get_app_handle(APP_NAME)
    ingress.drain_replicas.remote().result()
    logger.info("draining: new requests get 503; running ones have up to %.0f s to finish", timeout_s)
    time.sleep(2 * REPORT_PERIOD_S)  # every replica has had the order and reported since
    deadline = time.monotonic() + timeout_s + 15  # the replicas' own abort and flush come after timeout_s
    while time.monotonic() < deadline and not cut_short.is_set():
        if not any(ingress.replicas_status.remote().result().values()):
            logger.info("drained: every replica is idle")
            return
        time.sleep(0.25)


class _Signals:
    def __init__(self) -> None:
        self.first, self.second = threading.Event(), threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        (self.second if self.first.is_set() else self.first).set()


def main(argv: list[str] | None = None) -> int:
    server, models, scale = parse_args(argv)
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(server, models, scale)
    return 0


if __name__ == "__main__":
    sys.exit(main())
