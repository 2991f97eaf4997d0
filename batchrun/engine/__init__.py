"""The continuous-batching engine: token ids and sampling parameters in, tokens out.

Nothing here knows about OpenAI, HTTP or files.
"""

from batchrun.engine.outputs import CompletionOutput, RequestOutput
from batchrun.engine.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "RequestOutput", "SamplingParams"]
