"""`batchrun models check`: what running a model would take, from its config alone: the path that
runs it (or why none does), its parameters (counted on transformers' model built on the meta
device: nothing allocated, no weights read), weight and KV memory, and the engine features
that apply to it."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchrun.models.transformers.config_features import expert_counts, features
from batchrun.models.transformers.indexed import key_dim, widened
from batchrun.models.transformers.support import (UnsupportedModelError, as_transformers_config,
                                                  base_decoder, choose)

DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass
class CheckReport:
    model_type: str
    architectures: list[str]
    impl: str  # native | transformers | refused
    reason: str  # why this path, or why refused
    native_file: str = ""  # the native model file that runs it (impl native)
    parameters: int | None = None
    layers: int = 0
    kv_heads: int = 0
    k_head_dim: int = 0
    v_head_dim: int = 0
    features: list[tuple[str, str]] = field(default_factory=list)
    stored_quantized: str = ""  # a checkpoint stored quantized: its format and loaded weight size
    # A model with recurrent state (stateful.py): its layers and one request's state in float32
    # and in bfloat16 (a Gated DeltaNet's recurrent state stays float32 in either)
    state_layers: int = 0
    state_bytes_fp32: int = 0
    state_bytes_bf16: int = 0
    index_key_dim: int = 0  # an indexer's key the V cache keeps beside V (indexed.py)

    @property
    def kv_elements_per_token(self) -> int:
        """The cache stores K and V at the wider of their head dims (MLA: the other padded),
        widened where an indexer's key does not fit beside V."""
        return 2 * self.layers * self.kv_heads * widened(
            self.kv_heads, self.k_head_dim, self.v_head_dim, self.index_key_dim)


def attention_shape(hf) -> tuple[int, int, int]:
    """(KV heads, K head dim, V head dim) as the config describes them."""
    heads = hf.num_attention_heads
    if getattr(hf, "qk_nope_head_dim", None) is not None:  # MLA: K/V expanded per head
        return heads, hf.qk_nope_head_dim + hf.qk_rope_head_dim, hf.v_head_dim
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    return getattr(hf, "num_key_value_heads", None) or heads, head_dim, head_dim


def kv_shape(hf) -> tuple[int, int, int, int]:
    """(KV heads, K head dim, V head dim, KV caches per layer) as the model's layers call
    attention (one shape: the load refuses models whose layers differ; a cache per call:
    DiffLlama's 2), read by shapes_from_config; where its forward cannot run on meta tensors,
    as the config describes them (attention_shape), one cache per layer."""
    calls: dict = {}
    try:
        shapes, _ = shapes_from_config(hf, calls=calls)
    except Exception:  # data-dependent code in its forward, or no model from the config
        return (*attention_shape(hf.get_text_config()), 1)
    _, kv_heads, k_dim, v_dim = max(shapes.values())
    return kv_heads, k_dim, v_dim, max(calls.values(), default=1)


def meta_model(hf):
    """transformers' model for `hf` on the meta device (nothing allocated); None if it cannot be
    built (what needs it is not essential to the report)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from batchrun.models.weights.remote_code import config_kwargs
    from batchrun.models.transformers.vision import is_vision_language

    auto = AutoModelForImageTextToText if is_vision_language(hf) else AutoModelForCausalLM
    try:
        with torch.device("meta"):
            return auto.from_config(hf, **config_kwargs(hf))
    except Exception:  # a config transformers cannot build
        return None


def shapes_from_config(hf, hf_model=None, calls: dict | None = None) -> tuple[dict, dict]:
    """What probe.run reports (layer_idx -> attention shape; layer_idx -> window; in `calls`
    layer_idx -> its attention calls per step), without weights: transformers' model for `hf`
    (`hf_model`, else built) on the meta device run over the probe tokens with the attention
    function recording the shapes and returning zeros. Raises the probe's UnsupportedModelError
    (no attention through the interface, a bidirectional layer), and what transformers raises
    when its model cannot be built or run so."""
    import torch

    from batchrun.models.transformers import attention
    from batchrun.models.transformers.model import use_batchrun_attention
    from batchrun.models.transformers.probe import PROBE_IDS, check_attended

    hf_model = meta_model(hf) if hf_model is None else hf_model
    if hf_model is None:
        raise UnsupportedModelError(f"transformers cannot build {hf.model_type} from its config")
    use_batchrun_attention(hf_model)
    hf_model.to(torch.bfloat16)  # grouped expert GEMMs have meta kernels in bfloat16 only
    n = len(PROBE_IDS)
    ids = torch.zeros(1, n, dtype=torch.long, device="meta")
    shapes: dict = {}
    windows: dict = {}
    with torch.inference_mode(), attention.step(None, None, n, shapes, windows,
                                                calls_per_layer=None) as current:
        # An all-ones mask: without one, transformers' mask preparation reads the positions'
        # values (packed sequences), which meta tensors do not have.
        base_decoder(hf_model)(input_ids=ids, attention_mask=torch.ones_like(ids),
                               position_ids=torch.arange(n, device="meta")[None], use_cache=False)
    check_attended(hf.model_type, current)
    if calls is not None:
        calls.update(current.seen)
    return shapes, windows


def count_parameters(model) -> int | None:
    """Parameters of the model, tied ones once."""
    return None if model is None else sum(p.numel() for p in model.parameters())


def routed_expert_parameters(model, hf) -> int:
    """Parameters of the routed experts (`...experts.<weight>` with the expert count first,
    biases included); a shared expert and the router are not among them."""
    experts, _ = expert_counts(hf)
    if model is None or not experts:
        return 0
    return sum(p.numel() for name, p in model.named_parameters()
               if ".experts." in f".{name}" and p.dim() >= 2 and p.shape[0] == experts)


def routed_expert_shapes(model, hf) -> dict[tuple[int, int], int]:
    """(out, in) -> how many expert projections of that shape the routed experts' 3-D weights
    of transformers' `model` hold (gate and up fused, down); what a
    checkpoint stored quantized keeps in its format (models/quant/experts.py)."""
    experts, _ = expert_counts(hf)
    shapes: dict[tuple[int, int], int] = {}
    if model is None or not experts:
        return shapes
    params = dict(model.named_parameters())
    for name, p in params.items():
        if ".experts." in f".{name}" and p.dim() == 3 and p.shape[0] == experts:
            shape = (p.shape[1], p.shape[2])
            bias = params.get(f"{name}_bias")  # GPT-OSS's are [experts, in, out]: its bias says
            if bias is not None and bias.shape[-1] == shape[1] != shape[0]:
                shape = shape[::-1]
            shapes[shape] = shapes.get(shape, 0) + experts
    return shapes


def decoder_linear_shapes(model) -> dict[tuple[int, int], int]:
    """(out, in) -> how many linears of that shape --quantization replaces in transformers'
    `model` on the backend (transformers/quantized.py)."""
    from collections import Counter

    from batchrun.models.transformers.quantized import decoder_linears

    return dict(Counter((m.out_features, m.in_features) for m in decoder_linears(model).values()))


def lora_support(model, hf, impl: str) -> str:
    """Whether LoRA adapters run on the model, and on which of its modules."""
    if impl == "native":
        if expert_counts(hf)[0]:  # models/arch/moe.py, gpt_oss.py: experts are no linears
            from batchrun.models.arch import native

            n = native.native_module(hf).ModelConfig.from_hf(hf).sparse_layers.count(False)
            dense = f", and gate_proj, up_proj, down_proj of its {n} dense layer" \
                f"{'s' if n > 1 else ''}" if n else ""
            return f"yes: q_proj, k_proj, v_proj, o_proj (on the fused qkv_proj){dense}; not " \
                "the experts"
        return ("yes: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (on the "
                "fused qkv_proj and gate_up_proj)")
    if model is None:
        return "unknown (transformers cannot build the model from its config)"
    from batchrun.models.lora.targets import linear_targets
    from batchrun.models.transformers.vision import decoder_of

    try:
        targets = linear_targets(model, decoder_of(model, hf), hf.get_text_config().num_hidden_layers)
    except ValueError as exc:
        return f"no ({exc})"
    names = targets.module_names()
    if not names:
        return "no (its decoder layers hold no plain linears)"
    experts = sorted({type(m).__name__ for m in targets.layers.modules()
                      if any(p.dim() == 3 for p in m.parameters(recurse=False))})
    not_experts = f"; not {', '.join(experts)} (3-D expert weights)" if experts else ""
    return f"yes: {', '.join(names)} (the plain linears of its decoder layers{not_experts})"


def refused(hf, reason: str, impl: str = "refused") -> CheckReport:
    """The report's head: the model's type and architectures, the path and why."""
    full = as_transformers_config(hf)
    return CheckReport(getattr(full, "model_type", "?"), list(full.architectures or []),
                       impl, reason)


def check(hf, folder=None) -> CheckReport:
    """What `run` does with the model of config `hf` (in `folder`, where local: whether it holds
    a processor): the path and why, or the refusal `run` gives, from the config alone."""
    try:
        verdict = choose(hf, "auto")
        impl, reason = verdict.impl, verdict.note or "it runs the model exactly"
    except UnsupportedModelError as exc:
        impl, reason = "refused", str(exc)
    stored = None
    if impl != "refused":
        impl, reason, stored = _stored_quantized(hf, impl, reason)
    full = as_transformers_config(hf)
    text = full.get_text_config()  # a vision-language model's decoder's
    model = meta_model(full) if impl != "refused" else None
    from batchrun.models.transformers import stateful

    shape = None
    # native or backend: the state is the layers' (a native Qwen3-Next keeps the backend's)
    keeps_state = impl != "refused" and stateful.runs(full) and model is not None
    if keeps_state and not stateful.has_attention(model):
        shape = (0, 0, 0, 1)  # no attention layers: no KV cache
    elif impl == "transformers":
        impl, reason, shape = _probe_verdict(
            full, model, reason, stateful.no_kv_layers(model) if keeps_state else frozenset())
    if impl == "transformers":
        from batchrun.models.transformers.vision import verdict_before_load

        impl, reason = verdict_before_load(full, model, folder, impl, reason)
    report = refused(full, reason, impl)
    if impl == "refused":
        return report
    if impl == "native":
        from batchrun.models.arch import native

        report.native_file = native.native_module(hf).__name__.rsplit(".", 1)[-1] + ".py"
    report.parameters = count_parameters(model)
    report.kv_heads, report.k_head_dim, report.v_head_dim, per_layer = shape or kv_shape(full)
    report.layers = text.num_hidden_layers * per_layer  # KV caches, as the load sizes them
    report.index_key_dim = key_dim(text)
    report.features = features(text, impl, lora_support(model, full, impl))
    if shape == (0, 0, 0, 1):
        report.layers = 0
    if keeps_state:
        report.layers = len(stateful.attention_layer_ids(model)) * per_layer
        report.features[2] = ("LoRA", "no (models with recurrent state: not yet)")
        import torch

        spec = stateful.spec_of(model, torch.float32)
        report.state_layers, report.state_bytes_fp32 = len(spec.layers), spec.bytes_per_sequence
        report.state_bytes_bf16 = stateful.spec_of(model, torch.bfloat16).bytes_per_sequence
        report.features[0] = ("prefix caching", "yes (a hit resumes at the last state "
                                                "checkpoint it passes)" if spec.checkpoints else
                              "no (a cached block's KV does not give back a recurrent state; "
                              "each prompt is computed)")
        report.features[1] = ("chunked prefill", "yes (the state carried across chunks)")
    from batchrun.models.transformers.vision import is_vision_language

    if is_vision_language(full):
        report.features.append(("images", image_support(folder)))
    report.stored_quantized = "" if stored is None else _stored_size(stored, model, text)
    return report


def _probe_verdict(full, model, reason: str, no_kv: frozenset[int] = frozenset()):
    """(impl, reason, (KV heads, K dim, V dim, KV caches per layer) or None) after the load's probe run on the meta
    model: refused as the load refuses (attention outside the interface, a bidirectional
    layer, layers of different KV shapes); where the forward cannot run without weights the
    load's probe decides, and the shape is the config's."""
    from batchrun.models.transformers.model import config_of

    if model is None:
        return "refused", f"unsupported model: transformers cannot build {full.model_type} " \
            "from its config", None
    calls: dict = {}
    try:
        shapes, windows = shapes_from_config(full, model, calls)
        config = config_of(full.get_text_config(), shapes, windows, no_kv=no_kv)
    except UnsupportedModelError as exc:
        return "refused", str(exc), None
    except Exception as exc:  # data-dependent code in its forward: it needs real tensors
        return "transformers", f"{reason}; its attention shape is checked at load (its forward " \
            f"does not run without weights: {type(exc).__name__})", None
    k_dim, v_dim = max((s[2], s[3]) for s in shapes.values())
    return "transformers", reason, (config.num_kv_heads, k_dim, v_dim, max(calls.values(), default=1))


def image_support(folder) -> str:
    """Whether `run` takes images for a vision-language model in `folder`: with the processor
    saved there, else it runs as a text model (transformers/processor.py: has_processor)."""
    from batchrun.models.transformers.processor import processor_class

    if folder is None:
        return "unknown (not a local folder: with a processor saved, yes)"
    name = processor_class(folder)
    if name is None:
        return ("no: no processor saved with the model (processor_config.json or "
                "preprocessor_config.json naming a processor_class); it runs as a text model")
    return f"yes ({name}; the vision tower on PyTorch's SDPA)"


def _stored_quantized(hf, impl: str, reason: str):
    """(impl, reason, its CheckpointFormat) of a checkpoint stored quantized (None: a float
    one): refused where batchrun cannot run its method, or off the native path."""
    from batchrun.models.quant import QuantizationError, check_checkpoint, checkpoint_method

    if checkpoint_method(hf) is None:
        return impl, reason, None
    try:
        stored = check_checkpoint(hf)
    except QuantizationError as exc:
        return "refused", str(exc), None
    assert stored is not None  # checkpoint_method named a method
    if impl != "native":
        return "refused", (f"the checkpoint is stored quantized ({stored.method}), which loads on "
                           "the native path only"), None
    return impl, reason, stored


def _stored_size(stored, model, hf) -> str:
    """What the decoder's linears (not the logits layer or routers) and routed experts hold as
    stored (models/quant/experts.py)."""
    from collections import Counter

    import torch

    from batchrun.models.quant import kept_float

    shapes = Counter((m.out_features, m.in_features) for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and not kept_float(name)) \
        if stored.holds == "linears" else Counter()
    linears = sum(shapes.values())
    experts = routed_expert_shapes(model, hf)
    everything = shapes + Counter(experts)
    held = sum(stored.nbytes(*shape) * n for shape, n in everything.items())
    dense = sum(out * inp * 4 * n for (out, inp), n in everything.items())
    routed = f"{sum(experts.values()) // 2} routed experts" if experts else ""
    what = " and ".join(part for part in (f"{linears} linears" if linears else "", routed) if part)
    return (f"{stored.describe()}; its {what} hold {_size(held)} (float32: {_size(dense)}), the "
            "rest float32; CPU only")


def describe(name: str, report: CheckReport) -> list[str]:
    path = {"native": f"native (models/arch/{report.native_file})", "transformers": "transformers backend",
            "refused": "refused"}[report.impl]
    archs = ", ".join(report.architectures) or "no architectures listed"
    lines = [f"model: {name} ({report.model_type}; {archs})", f"path: {path} ({report.reason})"]
    if report.impl == "refused":
        return lines
    if report.parameters is not None:
        weights = ", ".join(f"{_size(report.parameters * b)} in {d}" for d, b in DTYPE_BYTES.items())
        lines.append(f"parameters: {report.parameters:,} ({weights})")
    if report.stored_quantized:
        lines.append(f"stored quantized: {report.stored_quantized}")
    if report.state_layers:
        per = (f"fp32 {_size(report.state_bytes_fp32)}, "
               f"bf16 {_size(report.state_bytes_bf16)}")
        lines.append(f"recurrent state: {report.state_layers} layers (convolution / SSM / "
                     f"linear-attention state): "
                     f"{per} per request, whatever its length")
    kv = ", ".join(f"{d} {_size(report.kv_elements_per_token * b)}" for d, b in
                   DTYPE_BYTES.items())
    if not report.layers:
        lines.append("KV cache: none (no attention layers)")
        lines += [f"  {k}: {v}" for k, v in report.features]
        return lines
    dims = (f"head dim {report.k_head_dim}" if report.k_head_dim == report.v_head_dim
            else f"K/V head dims {report.k_head_dim}/{report.v_head_dim}")
    width = widened(report.kv_heads, report.k_head_dim, report.v_head_dim, report.index_key_dim)
    if width > max(report.k_head_dim, report.v_head_dim):
        dims += f" (held {width} wide: the indexer's keys beside V)"
    lines.append(f"KV cache: {report.layers} layers x {report.kv_heads} KV heads x {dims}: "
                 f"{kv} per token")
    lines += [f"  {k}: {v}" for k, v in report.features]
    return lines


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover
