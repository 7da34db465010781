"""sglang-fp8rl: online DeepSeek-style blockwise FP8 rollout for SGLang (see README.md)."""

__version__ = "0.1.0"
