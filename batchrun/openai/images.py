"""Chat requests with image parts, for a vision-language model: the parts checked, their images
fetched (openai/media.py) and the conversation rendered through the model's processor, which
expands each image's placeholder tokens as transformers would."""

from __future__ import annotations

from typing import Any, Sequence

from batchrun.openai.media import MediaError, MediaFetcher, check_source
from batchrun.openai.requests import ChatMessage
from batchrun.openai.wire import RequestError
from batchrun.openai.render import template_call_kwargs, to_template_messages
from batchrun.options.openai import OpenAIOptions

DETAILS = ("auto", "low", "high")


def has_images(messages: Sequence[ChatMessage]) -> bool:
    return any(isinstance(m.content, list) and any(p.type == "image_url" for p in m.content)
               for m in messages)


def image_urls(messages: Sequence[ChatMessage], options: OpenAIOptions) -> list[tuple[str, str]]:
    """(param path of the url, url) of each image part in order; RequestError for a malformed
    part, a source refused without fetching, or more images than --limit-images-per-prompt."""
    found: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m.content, list):
            continue
        for j, part in enumerate(m.content):
            if part.type != "image_url":
                continue
            where = f"messages.{i}.content.{j}.image_url"
            spec = (part.model_extra or {}).get("image_url")
            if isinstance(spec, str):  # some clients send the URL itself
                spec = {"url": spec}
            if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
                raise RequestError(f"{where}: an image_url part needs an object with a 'url' string",
                                   code="invalid_value", param=where)
            if spec.get("detail") not in (None, *DETAILS):
                raise RequestError(f"{where}.detail: must be one of {', '.join(DETAILS)}",
                                   code="invalid_value", param=f"{where}.detail")
            if len(found) == options.limit_images_per_prompt:
                raise RequestError(
                    f"{where}: the request has more than {options.limit_images_per_prompt} "
                    f"images (--limit-images-per-prompt)", code="too_many_images", param=where)
            try:
                check_source(spec["url"], options)
            except MediaError as exc:
                raise RequestError(f"{where}.url: {exc}", code=exc.code,
                                   param=f"{where}.url") from None
            found.append((f"{where}.url", spec["url"]))
    return found


def check_images(messages: Sequence[ChatMessage], options: OpenAIOptions,
                 media: MediaFetcher | None = None) -> None:
    """image_urls' checks; with `media`, each image also fetched and decoded (validate
    --fetch-media)."""
    for where, url in image_urls(messages, options):
        if media is not None:
            try:
                media.image(url)
            except MediaError as exc:
                raise RequestError(f"{where}: {exc}", code=exc.code, param=where) from None


def render_with_images(processor: Any, messages: Sequence[ChatMessage], media: MediaFetcher,
                       *, tools: list[dict[str, Any]] | None = None,
                       chat_template: str | None = None, add_generation_prompt: bool = True,
                       continue_final_message: bool = False,
                       template_kwargs: dict[str, Any] | None = None):
    """(prompt token ids, engine.multimodal.MultiModalInputs) of a chat with image parts."""
    from batchrun.models.transformers.processor import render

    images = []
    for where, url in image_urls(messages, media.options):
        try:
            images.append(media.image(url))
        except MediaError as exc:
            raise RequestError(f"{where}: {exc}", code=exc.code, param=where) from None
    kwargs = template_call_kwargs(processor, tools, chat_template, continue_final_message,
                                  template_kwargs)
    template_messages = to_template_messages(messages, processor, chat_template, images=True)
    try:
        return render(processor, template_messages, images, add_generation_prompt, **kwargs)
    except Exception as exc:  # the template's or the processor's own checks
        raise RequestError(f"messages: the model's processor rejected them: {exc}",
                           code="invalid_messages", param="messages") from None
