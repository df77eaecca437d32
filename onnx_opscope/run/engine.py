"""Where batches run: in this process (`local`), or sharded over the workers of a Ray cluster (`ray`).

The Ray engine is an optional extra (`pip install 'onnx-opscope[ray]'`). Each worker is an actor
holding one onnxruntime session of the (instrumented) model, built once from the model bytes the
driver put in Ray's object store; a batch is one actor call that returns what the caller's `post`
makes of the outputs (for `record`, the few bytes per tensor the taps compute; for calibration,
per-batch min/max or [bins] counts), never a tensor. The driver keeps at most `in_flight` calls
outstanding per worker and yields the results in step order, so it holds a bounded number of
batches' results whatever the number of batches, and a table written from them has the rows a
single-process run writes, in the same order. Each batch goes to the worker that should be through
its queue first by its pace so far, not to worker i mod n: on a shared machine, or a cluster of
unequal nodes, a slowed worker takes fewer batches instead of setting everyone's pace.

An interrupted driver (Ctrl-C, SIGTERM through the CLI) stops taking results; the generator's
`finally` kills the actors, and the caller keeps what it wrote (`record`: whole batches 0..k-1).

Faults: an actor whose process dies is restarted by Ray (`max_restarts`) and the calls it had not
answered are run again (`max_task_retries`); the driver takes each step's result once, so a
killed worker loses no batch and duplicates none.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from onnx import ModelProto

from ..errors import OpscopeError, did_you_mean

ENGINES = ("local", "ray")
_PROTO_LIMIT = 2**31 - 1
Post = Callable[[int, dict[str, np.ndarray]], Any]  # (step, outputs) -> what comes back to the driver


@dataclass(frozen=True)
class Engine:
    """`kind`: "local" or "ray"; `address`: a Ray cluster to join (None: start a local one);
    `workers`: actors (None: one per CPU Ray reports); `in_flight`: outstanding calls per worker."""

    kind: str = "local"
    address: str | None = None
    workers: int | None = None
    in_flight: int = 4

    def __post_init__(self) -> None:
        if self.kind not in ENGINES:
            raise OpscopeError(
                f"unknown engine {self.kind!r}{did_you_mean(self.kind, ENGINES)}; choose one of: {', '.join(ENGINES)}"
            )
        if self.workers is not None and self.workers < 1:
            raise OpscopeError(f"workers {self.workers}: expected at least 1")


def import_ray() -> Any:
    """The ray module, or one line naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise OpscopeError(
            "--engine ray needs Ray, which is not installed",
            hint="pip install 'onnx-opscope[ray]'",
        ) from None
    return ray


def ensure_ray(engine: Engine) -> Any:
    """Ray, connected: to `engine.address` when given, else to a local instance started here."""
    ray = import_ray()
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {
            "include_dashboard": False,
            "log_to_driver": False,
            "configure_logging": False,
        }
        if engine.address:
            kwargs["address"] = engine.address
        try:
            ray.init(**kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = engine.address or "a local instance"
            raise OpscopeError(f"cannot start Ray ({where}): {str(exc).splitlines()[0]}") from None
    return ray


def serialized_for_workers(model: ModelProto) -> bytes:
    """The model as bytes for Ray's object store (external data stays a reference: the workers read
    it from the same folder, so it must be on storage they share)."""
    if model.ByteSize() > _PROTO_LIMIT:
        raise OpscopeError(
            "the model is over 2 GB with its weights inside: Ray workers cannot be sent it",
            hint="save it with external data (onnx.save(..., save_as_external_data=True)) on storage the workers share",
        )
    return model.SerializeToString()


def session_from_bytes(model_bytes: bytes, *, config: Any, base_dir: str | os.PathLike | None) -> Any:
    """A worker's session of the model the driver serialised (`make_session` as in this process)."""
    import onnx

    from .session import make_session

    return make_session(onnx.load_from_string(model_bytes), config, base_dir=base_dir, take_weights=True)


def sessions_for(
    engine: Engine,
    model: ModelProto,
    config: Any,
    base_dir: str | os.PathLike | None,
    weights_from: ModelProto | None = None,
) -> tuple[bytes | None, Callable[[bytes | None], Any]]:
    """(model bytes, session factory) for `run_batches`: locally one session built now (the proto's
    weights moved into it, or lent from `weights_from` when `model` is its weightless copy), on Ray
    the bytes each worker builds from (the weights put back in first)."""
    if engine.kind == "local":
        from .session import make_session

        session = make_session(model, config, base_dir=base_dir, take_weights=True, weights_from=weights_from)
        return None, lambda _: session
    ensure_ray(engine)  # before any work: a missing extra or an unreachable cluster is one line now
    if weights_from is not None:
        model = _with_weights(model, weights_from)
    return serialized_for_workers(model), partial(session_from_bytes, config=config, base_dir=base_dir)


def _with_weights(model: ModelProto, source: ModelProto) -> ModelProto:
    """A copy of the weightless `model` with `source`'s main-graph initializers put back."""
    full = ModelProto()
    full.CopyFrom(model)
    weights = {t.name: t for t in source.graph.initializer}
    for t in full.graph.initializer:
        if not t.raw_data and t.name in weights:
            t.CopyFrom(weights[t.name])
    return full


def worker_count(engine: Engine) -> int:
    ray = ensure_ray(engine)
    return engine.workers or max(1, int(ray.cluster_resources().get("CPU", 1)))


def run_batches(
    engine: Engine,
    model_bytes: bytes | None,
    session_factory: Callable[[bytes | None], Any],
    batches: Iterable[Mapping[str, np.ndarray]],
    want: list[str],
    post: Post,
) -> Iterator[tuple[int, Any]]:
    """(step, post(step, outputs)) for every batch, in step order, run where `engine` says.

    `session_factory(model_bytes)` builds the session a worker runs (locally: called once here).
    """
    if engine.kind == "local":
        session = session_factory(model_bytes)
        from .session import run

        for step, batch in enumerate(batches):
            yield step, post(step, dict(zip(want, run(session, batch, want))))
        return
    yield from _ray_batches(engine, model_bytes, session_factory, batches, want, post)


def _ray_batches(engine, model_bytes, session_factory, batches, want, post) -> Iterator[tuple[int, Any]]:
    ray = ensure_ray(engine)
    n = worker_count(engine)
    model_ref = ray.put(model_bytes)
    actor_cls = ray.remote(num_cpus=1, max_restarts=-1, max_task_retries=-1)(_Worker)
    # Ray resolves the reference for each actor, again after a restart: the driver keeps it alive until
    # the end (Ray's log warns that restartable actors with object-store arguments depend on that)
    actors = [actor_cls.remote(model_ref, session_factory, want, post) for _ in range(n)]
    pending: deque = deque()  # (step, ref) in step order, not yet yielded
    running: dict[Any, int] = {}  # ref -> its actor, for calls not yet seen done
    load = [0] * n  # calls outstanding per actor
    done = [0] * n  # calls answered per actor: how fast each has been
    window = n * engine.in_flight

    def settle(block: bool) -> None:
        """Note the calls that are done (waiting for one when `block`), freeing their actors' slots."""
        refs = list(running)
        ready, _ = ray.wait(refs, num_returns=1 if block else len(refs), timeout=None if block else 0)
        for ref in ready:
            i = running.pop(ref)
            load[i] -= 1
            done[i] += 1

    try:
        for step, batch in enumerate(batches):
            while True:
                if running:
                    settle(block=False)
                while pending and pending[0][1] not in running:  # the next step is done: yield it
                    s, ref = pending.popleft()
                    yield s, _get(ray, ref, s)
                if len(pending) < window and min(load) < engine.in_flight:
                    break
                settle(block=True)
            # the actor that should be through its queue first, by its pace so far: a slow one gets fewer
            free = [j for j in range(n) if load[j] < engine.in_flight]
            i = min(free, key=lambda j: (load[j] + 1) / (done[j] + 1))
            ref = actors[i].run.remote(step, dict(batch))
            pending.append((step, ref))
            running[ref] = i
            load[i] += 1
        while pending:
            s, ref = pending.popleft()
            yield s, _get(ray, ref, s)
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)


def _get(ray: Any, ref: Any, step: int) -> Any:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:  # the worker's own exception, re-raised as what it was
        cause = exc.as_instanceof_cause()
        if isinstance(cause, OpscopeError):
            raise OpscopeError(f"batch {step}: {cause}") from None
        raise OpscopeError(f"batch {step} failed on a Ray worker: {str(cause).splitlines()[0]}") from None


@dataclass(frozen=True)
class InOrder:
    """A `post` that returns the outputs as a list in `names` order."""

    names: list[str]

    def __call__(self, step: int, outputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [outputs[n] for n in self.names]


class _Worker:
    """One Ray actor: a session of the model, built once; state is real (the session)."""

    def __init__(self, model_bytes: bytes | None, session_factory, want: list[str], post: Post):
        self.session = session_factory(model_bytes)
        self.want, self.post = want, post

    def run(self, step: int, batch: dict[str, np.ndarray]) -> Any:
        from .session import run

        return self.post(step, dict(zip(self.want, run(self.session, batch, self.want))))
