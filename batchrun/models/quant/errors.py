"""The error a quantization method, device or checkpoint format batchrun cannot run raises."""


class QuantizationError(ValueError):
    """A quantization method this model, device or checkpoint cannot run; says which and why."""
