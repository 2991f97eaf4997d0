"""A vision-language model's processor (chat template with image placeholders, image resizing and
patching, placeholder expansion) from transformers, on its slow PIL/numpy image processors, so
neither torchvision nor a video processor is needed."""

from __future__ import annotations


def images_only(cls):
    """`cls` (a transformers ProcessorMixin class) built without a video processor: transformers
    checks every sub-processor's class, and looking up the video processors' classes needs
    torchvision even when the argument is None."""
    class ImagesOnly(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    if "video_processor" in cls.apply_chat_template.__code__.co_names:
        # SmolVLM's apply_chat_template reads the video processor's defaults even for images:
        # a stand-in answers them (the attribute itself stays None, as transformers saves it)
        ImagesOnly.video_processor = property(
            lambda self: self.__dict__.get("video_processor") or NoVideos(),
            lambda self, value: self.__dict__.__setitem__("video_processor", value))
    ImagesOnly.__name__ = ImagesOnly.__qualname__ = cls.__name__
    return ImagesOnly


def processor_cls(name: str):
    """transformers' processor class `name`. A module that declares torchvision although its
    image path needs none (PixtralProcessor's: numpy, and one helper it imports from the
    torchvision image processor that the PIL one defines too) gives transformers' placeholder
    class without it: its class is then built from the module's own source, that import read
    from the PIL image processor."""
    from transformers.models.auto.processing_auto import (PROCESSOR_MAPPING_NAMES,
                                                          model_type_to_module_name,
                                                          processor_class_from_name)

    cls = processor_class_from_name(name)
    if cls is None or type(cls).__name__ != "DummyObject":
        return cls
    for model_type, names in PROCESSOR_MAPPING_NAMES.items():
        if name in names:
            own = without_torchvision(model_type_to_module_name(model_type), name)
            if own is not None:
                return own
    return cls


def without_torchvision(module: str, name: str):
    """Class `name` of transformers.models.`module`'s processing module, its imports from the
    torchvision image processor read from the PIL one (None where there is none)."""
    import types
    from pathlib import Path

    import transformers

    folder = Path(transformers.__file__).parent / "models" / module
    source, pil = folder / f"processing_{module}.py", folder / f"image_processing_pil_{module}.py"
    if not (source.exists() and pil.exists()):
        return None
    code = source.read_text().replace(f"from .image_processing_{module} import",
                                      f"from .image_processing_pil_{module} import")
    import sys

    loaded = types.ModuleType(f"transformers.models.{module}.processing_{module}")
    loaded.__package__, loaded.__file__ = f"transformers.models.{module}", str(source)
    # transformers' docstring decorator reads the class's source through its module
    sys.modules[loaded.__name__] = loaded
    exec(compile(code, str(source), "exec"), loaded.__dict__)
    return getattr(loaded, name, None)


class NoVideos:
    """In place of a video processor, for processors whose chat template step reads its
    defaults: no frames are sampled, as there are no videos."""
    num_frames = None
    fps = None


def processor_settings(path) -> dict:
    """preprocessor_config.json and processor_config.json of the folder at `path`, merged, the
    processor's own settings over its image processor's (Pixtral's patch_size: an int there, a
    dict in the image processor's)."""
    from pathlib import Path

    from batchrun.models.weights.json_file import read_object

    settings: dict = {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        if (Path(path) / name).exists():
            settings.update(read_object(Path(path) / name))
    return settings


def processor_class(path) -> str | None:
    """The processor class the folder at `path` saves (None: it has no processor, and a
    vision-language model in it runs as a text model)."""
    name = processor_settings(path).get("processor_class")
    return str(name) if name else None


def load_processor(path, trust_remote_code: bool = False):
    """The processor saved with the model at `path` (processor_config.json / preprocessor_config.json
    and the tokenizer), its image processor the slow one; the folder's own code only when
    `trust_remote_code` (models/weights/remote_code.py)."""
    from pathlib import Path

    from transformers import AutoImageProcessor, AutoTokenizer

    from batchrun.models.weights.json_file import read_object
    from batchrun.models.weights.remote_code import auto_kwargs, check_folder
    from batchrun.models.errors import naming

    path = Path(path)
    check_folder(path, trust_remote_code)
    settings = processor_settings(path)
    cls_name = settings.get("processor_class")
    if not cls_name:
        raise ValueError(f"{path} has no processor_class in its processor config")
    trust = auto_kwargs(trust_remote_code)
    with naming(path, "transformers cannot read its processor"):
        cls = images_only(processor_cls(str(cls_name)))
        image_processor = AutoImageProcessor.from_pretrained(path, backend="pil", **trust)
        tokenizer = AutoTokenizer.from_pretrained(path, **trust)
    template = None
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    elif (path / "chat_template.json").exists():
        template = read_object(path / "chat_template.json").get("chat_template")
    template = template or getattr(tokenizer, "chat_template", None)
    accepted = set(__import__("inspect").signature(cls.__init__).parameters)
    extra = {k: v for k, v in settings.items() if k in accepted and k not in (
        "image_processor", "tokenizer", "video_processor", "chat_template")}
    if "video_processor" in accepted:  # required by some (SmolVLM); images need none
        extra["video_processor"] = None
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=template,
               **extra)


def image_hash(image) -> bytes:
    """The content hash of a decoded PIL image (its mode, size and pixels): the key of the
    encoder cache and of the prefix-cache blocks over its placeholders."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.mode}:{image.size}".encode())
    h.update(image.tobytes())
    return h.digest()


TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "labels")


def render_image(processor, image, template_kwargs: dict):
    """engine.multimodal.ImageInput of one image: the processor's own output for a chat of that
    image alone: its tensors (pixel_values, grids, sizes, ...) and the token ids it wrote, so
    every family counts its image's placeholders as transformers does."""
    from batchrun.engine.multimodal import ImageInput

    alone = [{"role": "user", "content": [{"type": "image"}]}]
    template = {k: v for k, v in template_kwargs.items() if k == "chat_template"}
    try:
        text = processor.apply_chat_template(alone, add_generation_prompt=False,
                                             tokenize=False, **template)
    except Exception:  # a template that wants more than one image message: the bare marker
        text = processor.image_token
    out = processor(text=[text], images=[image], return_tensors="pt")
    data = {k: v for k, v in out.items() if k not in TEXT_KEYS}
    return ImageInput(image_hash(image), data, tuple(out["input_ids"][0].tolist()))


def render(processor, messages: list[dict], images: list, add_generation_prompt: bool = True,
           **template_kwargs):
    """(prompt token ids, engine.multimodal.MultiModalInputs) of a chat whose image parts are
    {"type": "image"} in order, `images` their decoded PIL images: the chat template's text with
    the processor's placeholders expanded as it would for transformers' generate; each image's
    own tensors and placeholder count from the processor on that image alone (one per
    encoder-cache entry)."""
    from batchrun.engine.multimodal import MultiModalInputs

    text = processor.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, **template_kwargs)
    out = processor(text=[text], images=images or None, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    if not images:
        return ids, None
    return ids, MultiModalInputs([render_image(processor, image, template_kwargs)
                                  for image in images])
