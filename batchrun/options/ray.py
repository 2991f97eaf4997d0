"""Options of a run on Ray: where the cluster is and how the engine replicas are shaped."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from batchrun.options.fields import option


class RayOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    SECTION: ClassVar[str] = "scale-out"

    ray: bool = option(False, "Run the engine as replicas on Ray. The driver reads, validates, "
                       "commits and writes as a local run does.")
    ray_address: str | None = option(
        None, "The Ray cluster: auto or ray://HOST:PORT [default: start a local Ray instance]. "
        "auto is the cluster `ray start` runs on this machine.", metavar="ADDRESS")
    replicas: int = option(1, "Engine replicas (each loads the model once).", ge=1)
    gpus_per_replica: float = option(0.0, "GPUs each replica reserves.", ge=0)
    cpus_per_replica: float = option(1.0, "CPUs each replica reserves (and its torch threads).",
                                     ge=0.01)
