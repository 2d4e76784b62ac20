__version__ = "0.1.0"


# %% ../nbs/04_engine.ipynb #936db177
from minivllm.engine import LLM, LLMEngine, RequestOutput, CompletionOutput
from minivllm.scheduler import SamplingParams