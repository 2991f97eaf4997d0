"""reference/errors.md and reference/exit-codes.md. The error codes are found in the source
(codes_scan.py) and each needs a line here: the build fails on a code without one, or on a line
for a code the source no longer gives, so the page cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

from codes_scan import scan
from md import table

ERRORS = {
    "invalid_json": "The line (or an HTTP body) is not JSON, or nests deeper than the limit.",
    "invalid_encoding": "The line's bytes are not UTF-8.",
    "missing_required_parameter": "A required field is missing; `param` names it.",
    "invalid_type": "A field has the wrong type; `param` names it.",
    "invalid_value": "A field's value is out of range or malformed; `param` names it.",
    "unsupported_value": "A value batchrun does not take (a `suffix`, a stored response, a "
                         "built-in tool, a file part, ...); `param` names it.",
    "invalid_url": "The line's `url` is not one of the endpoints.",
    "unsupported_endpoint": "An endpoint of OpenAI's Batch API that batchrun does not serve.",
    "duplicate_custom_id": "An earlier line of the job already used this `custom_id`.",
    "model_not_found": "`body.model` names neither the loaded model, an alias, a LoRA adapter "
                       "nor `default` (404 over HTTP).",
    "context_length_exceeded": "The prompt (plus `max_tokens`) does not fit the context.",
    "max_tokens_per_request": "A request asks for more prompts or inputs than one request may "
                              "carry.",
    "invalid_messages": "The conversation cannot be rendered by the chat template.",
    "tools_not_supported": "The request has `tools` but the chat template does not render "
                           "them (give `--chat-template`).",
    "unsupported_content": "A content part the model cannot take (an image on a text model).",
    "unsupported_task": "The model cannot do this endpoint (classify without a head, chat on "
                        "a classifier, ...).",
    "too_many_images": "More images than `--limit-images-per-prompt`.",
    "image_fetch_failed": "An image could not be fetched (unreachable, 404, timeout after the "
                          "retries).",
    "invalid_image": "An image is not an image, or is truncated or corrupt.",
    "image_too_large": "An image has more bytes or pixels than the limits allow.",
    "unsupported_image_format": "An image in a format batchrun does not decode.",
    "media_path_not_allowed": "A local image outside `--allowed-media-path`.",
    "media_host_not_allowed": "An image URL whose host is not public and not allowed by "
                              "`--allow-media-host`.",
    "batch_expired": "The job's `--deadline` (or a batch's completion window) passed before "
                     "the line ran.",
    "internal_error": "The line failed unexpectedly (500); the job goes on.",
    "engine_error": "The engine step running the request failed (500); the engine goes on.",
    "engine_dead": "The server's engine stopped after repeated failures (503).",
    "aborted": "The request was aborted before it finished.",
    "client_disconnected": "The HTTP client went away; its request was aborted.",
    "queue_full": "More interactive requests in flight than `--max-queued-requests` (429).",
    "not_found": "An HTTP route, file or batch that does not exist (404).",
    "invalid_state": "A Batches API call the batch's state does not allow (cancel a finished "
                     "batch).",
    "empty_file": "A Batches API input file without a request.",
}


def errors(package: Path) -> str:
    found = scan(package)
    missing = sorted(set(found) - set(ERRORS))
    stale = sorted(set(ERRORS) - set(found))
    if missing or stale:
        raise RuntimeError(f"docs/gen/ref_codes.py ERRORS is out of date: codes without a line "
                           f"{missing}, lines for codes the source does not give {stale}")
    rows = [[f"`{code}`", ERRORS[code], ", ".join(f"`{m}`" for m in sorted(found[code]))]
            for code in sorted(found)]
    return "\n".join([
        "# Error codes\n",
        "The `code` of a failed line's error (in the error file, `response.body.error.code`, "
        "or `error.code` for a line without a custom_id), of `batchrun validate`'s report and "
        "of an HTTP error answer. Found in batchrun's source when this site is built.\n",
        table(["code", "meaning", "given by"], rows)])


def exit_codes() -> str:
    from batchrun import commandkit
    from batchrun.batch.shell.commands import EXIT_CODES_HELP

    lines = re.findall(r"^\s+(\d+)\s+(.+(?:\n\s{6,}.+)*)", EXIT_CODES_HELP, re.M)
    meanings = {int(code): " ".join(text.split()) for code, text in lines}
    constants = {v: k for k, v in vars(commandkit).items() if k.startswith("EXIT_")}
    if set(meanings) != set(constants):
        raise RuntimeError(f"exit codes in --help {sorted(meanings)} differ from commandkit's "
                           f"{sorted(constants)}")
    rows = [[f"`{code}`", f"`{constants[code]}`", meanings[code]] for code in sorted(meanings)]
    return "\n".join([
        "# Exit codes\n",
        "What `batchrun run` and `batchrun job` exit with, as their `--help` prints it "
        "(`batchrun validate`: 0 every line is valid, 3 some are not, 2 usage error).\n",
        table(["code", "name", "meaning"], rows)])
