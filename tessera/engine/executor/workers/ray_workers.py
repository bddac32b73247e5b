"""Worker ranks as Ray actors: `--distributed-executor-backend ray` puts them on any node of the Ray
cluster this process is connected to (`ray start --head` on one node, `ray start --address=<head>:6379` on
the others, then start Tessera on a node of the cluster; RAY_ADDRESS picks a cluster, otherwise a local
Ray instance is started). Each actor asks Ray for one GPU (CUDA models) or one CPU."""

from __future__ import annotations

import os
from typing import Any, Optional

from ....config import ModelConfig
from .base import WorkerGroup
from .worker import run_worker


class _RankActor:
    def pid(self) -> int:
        return os.getpid()

    def run(self, *args: Any) -> None:
        run_worker(*args)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "distributed_executor_backend='ray' needs Ray: pip install 'tessera[ray]' (or pip install ray)"
        ) from e
    return ray


class RayWorkers(WorkerGroup):
    backend_name = "ray"

    def _driver_host(self) -> str:
        ray = _import_ray()
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
        return ray.util.get_node_ip_address()

    def _spawn(self, host: str, port: int, model_config: ModelConfig) -> None:
        ray = _import_ray()
        resources = {"num_gpus": 1} if self.backend == "nccl" else {"num_cpus": 1}
        actor_cls = ray.remote(_RankActor)
        self.actors, self.runs, self.failures = [], {}, {}
        for rank in range(1, self.world_size):
            # two threads: `run` never returns while the engine lives, `pid` answers beside it
            actor = actor_cls.options(max_concurrency=2, **resources).remote()
            args = (rank, self.world_size, host, port, self.backend, model_config, self.num_threads)
            self.runs[actor.run.remote(*args)] = rank
            self.actors.append(actor)

    def pids(self) -> list[int]:
        """The worker processes' ids (rank 1 first)."""
        ray = _import_ray()
        return ray.get([actor.pid.remote() for actor in self.actors])

    def _dead_workers(self) -> list[str]:
        return self._collect(0)

    def _wait_for_death(self, timeout: Optional[float]) -> list[str]:
        return self._collect(timeout)

    def _collect(self, timeout: Optional[float]) -> list[str]:
        ray = _import_ray()
        pending = [ref for ref in self.runs if self.runs[ref] not in self.failures]
        if pending:
            done, _ = ray.wait(pending, num_returns=1, timeout=timeout)
            for ref in done:
                try:
                    ray.get(ref)
                    message = "stopped"
                except Exception as e:  # RayActorError (the process died) or the worker's own exception
                    message = f"failed: {type(e).__name__}: {str(e).strip()[-2000:]}"
                self.failures[self.runs[ref]] = message
        return [f"rank {rank} (Ray actor) {message}" for rank, message in sorted(self.failures.items())]

    def _stop(self) -> None:
        ray = _import_ray()
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:
                pass
