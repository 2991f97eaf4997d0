"""An EngineClient over engine replicas on Ray: the batch runner drives it exactly like a local
engine (add_request / step / abort_request), so reading, validation, commits, resume and the
output files are the local run's own.

Routing (distributed/routing.py): a request goes to the replica that was sent the longest
prefix of its prompt (whole KV blocks), unless that one is clearly busier than the least loaded:
requests that share a few-shot block share a replica and its prefix cache. Adds are buffered and sent one remote call per replica per step; each replica has
one `collect` call outstanding at a time, and step() returns what the first ones to answer
finished.

Faults: a replica whose call fails with an actor error is replaced by a new actor (which loads
the model again) and every request it still had is sent again. The runner records a line only
when its output arrives, so a line is never lost and never written twice.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from batchrun.distributed.routing import PrefixRouter, images_key
from batchrun.engine.client import EngineStats
from batchrun.options.ray import RayOptions
from batchrun.served_model import TokenizerModel, system_fingerprint

log = logging.getLogger("batchrun.distributed")


def init_ray(options: RayOptions, env: dict[str, str] | None = None) -> None:
    import ray

    if ray.is_initialized():
        return
    runtime_env = {"env_vars": env} if env else None
    if options.ray_address:
        ray.init(address=options.ray_address, runtime_env=runtime_env, log_to_driver=False)
    else:
        ray.init(runtime_env=runtime_env, log_to_driver=False, include_dashboard=False)


class RayEngineClient:
    """The EngineClient protocol (engine/client.py) over `options.replicas` actors."""

    def __init__(self, options: RayOptions, load: Callable, model: str | None,
                 engine_config: Any, collect_timeout: float = 0.05):
        import ray

        from batchrun.distributed.replica import EngineReplica

        self.options, self.collect_timeout = options, collect_timeout
        # ray's stubs type remote()'s task options only; max_concurrency is an actor option.
        self._actor_class = ray.remote(num_cpus=options.cpus_per_replica,  # type: ignore[call-overload]
                                       num_gpus=options.gpus_per_replica,
                                       max_concurrency=4)(EngineReplica)
        self._make = lambda: self._actor_class.remote(
            load, model, engine_config, max(1, int(options.cpus_per_replica)))
        self.replicas = [self._make() for _ in range(options.replicas)]
        info = ray.get([r.info.remote() for r in self.replicas])
        self.max_model_len = info[0]["max_model_len"]
        self.name = info[0]["name"]
        # as a local engine's, loaded (the responses' system_fingerprint)
        self.config = info[0].get("config") or engine_config
        self._pending: list[list[tuple]] = [[] for _ in self.replicas]
        self._collecting: dict[Any, tuple[int, Any]] = {}  # collect ref -> (index, actor)
        self._adding: dict[Any, tuple[int, Any]] = {}  # add ref -> (index, actor)
        self._open: dict[str, tuple[int, tuple]] = {}  # request id -> (replica, its request)
        self.restarts = 0
        self.router = PrefixRouter(len(self.replicas))
        self._stats: list[EngineStats] = [EngineStats() for _ in self.replicas]
        self._stats_at = 0.0
        self._delivered_since_stats = False  # outputs arrived after the last stats fetch

    # --- the EngineClient protocol ----------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: Any,
                    arrival_time: float | None = None, stream: bool = False,
                    priority: int | None = None, multimodal=None) -> None:
        index = self.router.choose(prompt_token_ids, images_key(multimodal))
        # The images travel with the request, as the processor's tensors the driver rendered
        # (DESIGN.md, Images): a replica never fetches, and a resend carries them again.
        request = (request_id, list(prompt_token_ids), params, multimodal)
        self._open[request_id] = (index, request)
        self._pending[index].append(request)

    def abort_request(self, request_id: str) -> None:
        entry = self._open.pop(request_id, None)
        if entry is not None:
            self.router.done(entry[0])
            self._pending[entry[0]] = [r for r in self._pending[entry[0]] if r[0] != request_id]
            self.replicas[entry[0]].abort.remote([request_id])

    def has_unfinished_requests(self) -> bool:
        return bool(self._open)

    def step(self) -> list[Any]:
        import ray

        self._flush()
        for index in range(len(self.replicas)):
            busy = any(i == index for i, _ in self._collecting.values())
            if not busy and any(i == index for i, _ in self._open.values()):
                actor = self.replicas[index]
                self._collecting[actor.collect.remote(self.collect_timeout)] = (index, actor)
        if not self._collecting:
            return []
        ready, _ = ray.wait(list(self._collecting), num_returns=1,
                            timeout=self.collect_timeout * 20)
        outputs = []
        for ref in ready:
            index, actor = self._collecting.pop(ref)
            try:
                finished = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._replace(index, actor, exc)
                continue
            for out in finished:
                entry = self._open.pop(out.request_id, None)
                if entry is not None:
                    self.router.done(entry[0])
                    outputs.append(out)
                    self._delivered_since_stats = True
        self._check_adds()
        return outputs

    @property
    def stats(self) -> EngineStats:
        """The replicas' counters added up: refreshed at most once a second while requests are
        open, and once more when the last open one has finished, so what a run's metrics read
        at its end counts every request (a replica counts an output before handing it over)."""
        import ray

        settled = not self._open and self._delivered_since_stats
        if settled or time.monotonic() - self._stats_at > 1.0:
            try:
                self._stats = ray.get([r.stats.remote() for r in self.replicas], timeout=30)
                self._delivered_since_stats = False
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            self._stats_at = time.monotonic()
        total = EngineStats()
        for s in self._stats:
            for f in dataclasses.fields(EngineStats):
                if f.name == "peak_kv_usage":
                    total.peak_kv_usage = max(total.peak_kv_usage, s.peak_kv_usage)
                else:
                    setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
        return total

    def replica_stats(self) -> list[dict[str, Any]]:
        """Per replica: requests and prompt tokens served from its prefix cache (the metrics)."""
        self.stats  # noqa: B018 - refresh
        return [{"replica": i, "requests_finished": s.requests_finished,
                 "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens}
                for i, s in enumerate(self._stats)]

    def shutdown(self) -> None:
        import ray

        for actor in self.replicas:
            ray.kill(actor)

    # --- internals --------------------------------------------------------------------------

    def _flush(self) -> None:
        for index, batch in enumerate(self._pending):
            if batch:
                actor = self.replicas[index]
                self._adding[actor.add.remote(batch)] = (index, actor)
                self._pending[index] = []

    def _check_adds(self) -> None:
        """An add that failed on a dead actor: replace it (its requests are sent again)."""
        import ray

        if not self._adding:
            return
        done, _ = ray.wait(list(self._adding), num_returns=len(self._adding), timeout=0)
        for ref in done:
            index, actor = self._adding.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._replace(index, actor, exc)

    def _replace(self, index: int, actor: Any, exc: BaseException) -> None:
        import ray

        if self.replicas[index] is not actor:
            return  # already replaced (its add and its collect both failed)
        self.restarts += 1
        log.warning("engine replica %d died (%s): starting a new one and sending its %d "
                    "unfinished requests again", index, type(exc).__name__,
                    sum(1 for i, _ in self._open.values() if i == index))
        try:
            ray.kill(self.replicas[index])
        except Exception:  # already gone
            pass
        self.replicas[index] = self._make()
        self._collecting = {r: v for r, v in self._collecting.items() if v[0] != index}
        self._adding = {r: v for r, v in self._adding.items() if v[0] != index}
        self._pending[index] = [request for i, request in self._open.values() if i == index]
        self._stats[index] = EngineStats()
        self.router.forget(index)


class RayModel:
    """A ServedModel (batchrun/served_model.py) driver side: the tokenizer (no weights here)
    and the engine client over the replicas."""

    # Known on the replicas only: the tokenizer's EOS and the full vector width apply here.
    eos_token_ids: tuple[int, ...] = ()
    hidden_size: int | None = None

    def __init__(self, engine: RayEngineClient, served: TokenizerModel):
        self.engine = engine
        self.engine_config = engine.config
        self.tokenizer = served.tokenizer
        self.name = engine.name
        self.aliases = tuple(served.aliases)
        self.adapters = tuple(engine.config.lora.adapters)
        self.generation_defaults = dict(served.generation_defaults)
        self.max_model_len = engine.max_model_len
        # The model folder (a classifier's labels, sentence-transformers pooling), where local.
        self.path: Path | None = served.path
        # Lines with images render (and their images are fetched) here: the replicas get the
        # processor's tensors with the request.
        self.processor = served.processor

    @property
    def fingerprint(self) -> str:
        return system_fingerprint(self.name, self.engine_config)


def ray_loader(options: RayOptions, load: Callable) -> Callable[[str | None, Any], RayModel]:
    """A model loader (what commandkit.on_ray gives run and sweep for --ray) that starts the
    replicas on Ray, each loading the model with `load`, and gives the driver the tokenizer only."""

    def load_on_ray(model: str | None, engine_config: Any) -> RayModel:
        from batchrun.footprint import tokenizer_model

        init_ray(options)
        served = tokenizer_model(model, engine_config.max_model_len,
                                 engine_config.trust_remote_code)
        return RayModel(RayEngineClient(options, load, model, engine_config), served)
    return load_on_ray
