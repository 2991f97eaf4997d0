"""reference/lines.md: the shapes of batch input lines, their bodies per endpoint, output and
error lines and the Parquet result columns, read from batchrun's pydantic models and schema."""

from __future__ import annotations

from md import default_text, table, type_name


def _fields(model) -> str:
    rows = [[f"`{info.alias or name}`", type_name(info.annotation), default_text(info)]
            for name, info in model.model_fields.items()]
    return table(["field", "type", "default"], rows)


def render() -> str:
    from batchrun.batch.storage.parquet import RESULT_SCHEMA
    from batchrun.openai.wire import (ENDPOINTS, BatchInputLine, BatchLineError,
                                      BatchOutputLine, BatchResponse, ErrorBody)

    out = ["# Input and output lines\n",
           "Generated from batchrun's request and result models when this site is built. Field "
           "names and meanings follow OpenAI's API (and vLLM's extensions, such as `top_k`, "
           "`min_p`, `prompt_logprobs`); a field outside these lists is logged once and "
           "ignored, and a value outside a field's range is that line's 400 error.\n",
           "## A batch input line\n",
           "One JSON object per line (or one Parquet row); `url` picks the body's shape.\n",
           _fields(BatchInputLine),
           "## Bodies by endpoint\n"]
    for url, model in ENDPOINTS.items():
        out += [f"### `{url}`\n", f"`{model.__name__}`\n", _fields(model)]
    out += ["## A result line\n",
            "One per input line, in input order, in the output file (a result) or the error "
            "file (a failed line). A failed line that has a `custom_id` carries the HTTP "
            "answer an API would give in `response` (`status_code` 4xx/5xx, the error in "
            "`response.body.error`) and `\"error\": null`; a line read too badly to have one "
            "(bad JSON, not UTF-8) has `\"response\": null` and the error in `error`.\n",
            _fields(BatchOutputLine),
            "### `response`\n", _fields(BatchResponse),
            "### `response.body.error` (a failed request)\n", _fields(ErrorBody),
            "### `error` (a line without a custom_id, or an expired one)\n",
            _fields(BatchLineError),
            "## Parquet results\n",
            "With a `.parquet` output, one row per line with these columns:\n",
            table(["column", "type"], [[f"`{f.name}`", str(f.type)] for f in RESULT_SCHEMA])]
    return "\n".join(out)
