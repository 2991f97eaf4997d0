"""Options of one batch job (`batchrun run`, `plan`, job specs, a Batches-API batch): where the
inputs and results are, how the job survives failures, how it reports."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from batchrun.options.durations import parse_deadline
from batchrun.options.fields import option

# Seconds a lease may live without a heartbeat: below, a holder's renewals (every TTL/4) race
# its own expiry; above, a crashed run blocks its output for more than a day. A lease file
# naming a TTL outside this range is not one a batchrun run wrote (job/lease.py).
LEASE_TTL_RANGE = (5.0, 86400.0)

FormatName = Literal["jsonl", "jsonl.gz", "jsonl.zst", "jsonl.bz2", "jsonl.xz", "parquet"]


class InputOptions(BaseModel):
    """What the job reads (also `validate` and `plan`)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    SECTION: ClassVar[str] = "input and output"

    input: list[str] = option(
        list, "Files, folders, globs, fsspec URLs or - for stdin, read as one job.", cli=False)
    model: str | None = option(
        None, "Registry name, HF folder, .gguf file or hub id [default: the bundled "
        "smollm2-135m].", section="model")
    storage_options: dict[str, Any] | None = option(
        None, "fsspec options for object stores, as JSON. For example '{\"endpoint_url\": "
        "\"http://127.0.0.1:9000\"}', or keyed by protocol: '{\"s3\": {...}, \"http\": {...}}'.")
    input_format: FormatName | None = option(None, "Override the input extension.")
    columns: dict[str, str] = option(
        dict, "Parquet input: read the request field FIELD from COLUMN. Repeatable; FIELD is "
        "custom_id, body, messages, prompt or a request field such as max_tokens.",
        flag="--column", metavar="FIELD=COLUMN")

    @field_validator("input", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class JobOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    SECTION: ClassVar[str] = "input and output"
    RELIABILITY: ClassVar[str] = "reliability"  # resume, leases, deadlines, failures, signals

    output: str = option(..., "Output file: path, fsspec URL (s3://, gs://) or - for stdout.",
                         short="-o")
    errors: str | None = option(None, "Error file [default: <output stem>.errors.<ext>]. Under -o "
                                "- error records go to stdout with the results.")
    metrics: str | None = option(None, "Metrics JSON [default: <output stem>.metrics.json].")
    output_format: FormatName | None = option(None, "Override the output extension.")
    max_in_flight: int | None = option(
        None, "Requests handed to the engine at once [default: 4 x max-num-seqs].", ge=1,
        section="engine")
    staging: str | None = option(
        None, "Where results are committed while the job runs [default: "
        "<output>.batchrun-staging]. With -o -, a temporary folder.", metavar="URL")
    resume: bool = option(False, "Continue an interrupted run: only lines without a committed "
                          "result run. With nothing to resume, it starts afresh.",
                          section=RELIABILITY)
    restart: bool = option(False, "Discard what an interrupted run committed.", section=RELIABILITY)
    overwrite: bool = option(False, "Replace an output or error file that is not this job's own "
                             "result. Without it, that is a usage error.",
                             section=RELIABILITY)
    lease_ttl: float = option(
        60.0, "Seconds after a lease's last heartbeat before another run takes it. The holder "
        "renews its lease on the output every TTL/4; a crashed run's lease is taken over after the "
        "TTL, and on the same machine a dead process's lease at once.", ge=LEASE_TTL_RANGE[0],
        le=LEASE_TTL_RANGE[1], section=RELIABILITY)
    on_changed_input: Literal["rerun", "fail"] = option(
        "rerun", "On resume, an edited line: rerun it, or fail with exit 2. A line is edited when "
        "its content changed since its result was committed.", section=RELIABILITY)
    deadline: str | None = option(
        None, "Stop at this time: a duration (24h, 30m, 1h30m) or an ISO 8601 timestamp. Lines not "
        "done by then get batch_expired error lines (exit code 4); --resume later runs only "
        "those.", metavar="DURATION|TIMESTAMP", section=RELIABILITY)
    retry_failed: bool = option(False, "With --resume, also rerun lines that failed with a "
                                "retryable error. Retryable: engine and internal errors, not "
                                "validation errors.",
                                section=RELIABILITY)
    max_failed_fraction: float | None = option(
        None, "Exit with code 3 when more than this fraction of lines failed [default: no "
        "limit].", ge=0, le=1, section=RELIABILITY)
    grace_period: float = option(10.0, "Seconds in-flight requests get to finish after "
                                 "SIGTERM/SIGINT.", ge=0, section=RELIABILITY)
    commit_interval: float = option(2.0, "Seconds a finished result may wait before it is "
                                    "committed.", ge=0, section=RELIABILITY)
    commit_every: int = option(1000, "Records per committed part at most.", cli=False, ge=1)
    merge_on_stop: bool = option(False, "After a stop, still write what is done (the server's "
                                 "cancel).", cli=False)
    record_latency: bool = option(
        False, "Add latency_s (seconds from admission to the engine to the last output) to "
        "each result record, beside OpenAI's fields (sweeps' own files).", cli=False)
    progress: Literal["auto", "bar", "log", "none"] = option(
        "auto", "Progress as a bar or as log lines; auto: a bar on a terminal. Log lines have no "
        "carriage returns, for scheduler logs.")
    log_interval: float = option(30.0, "Seconds between progress log lines.", ge=0)
    quiet: bool = option(False, "No progress and no summary; warnings only.", short="-q")
    log_level: Literal["debug", "info", "warning", "error"] | None = option(
        None, "Log level of batchrun's messages [default: info; warning with -q]. debug adds the "
        "start-up phase timings (imports, weights, tokenizer, kernels, first step).")


    @field_validator("deadline")
    @classmethod
    def _a_deadline(cls, value: str | None) -> str | None:
        if value is not None:
            parse_deadline(value, 0.0)  # ValueError: pydantic names the field
        return value


class PlanOptions(BaseModel):
    """`batchrun plan`: how the estimate is made and shown."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    SECTION: ClassVar[str] = "plan"

    calibration: Literal["auto", "last-run", "benchmark"] = option(
        "auto", "What calibrates the time estimate: past runs or a micro-benchmark. last-run: the "
        "recent completed runs of this model on this machine that did enough work (16 requests or "
        "more); benchmark: a few-second micro-benchmark of the engine; auto: those runs where "
        "there are any, else the benchmark.")
    as_json: bool = option(False, "Print the plan as one JSON object.", name="json")
