"""The wire protocol between a trainer and an engine served with `fp8_online_blockwise`: every name that one side
writes and the other reads, defined once here. Imports nothing, so that either side (and a script) may use it.

One name here is SGLang's, not ours, and is kept here so that nothing defines it twice: the load format
``flattened_bucket``. SGLang's session routes and its "already open" refusal stay with weight_sync/session.py.
"""

# control entries: (name, tensor) items of an update request that carry no weights
CONTROL_PREFIX = "fp8rl."  # a weight name never starts with it; an unknown control name is refused
STEP_COMPLETE = CONTROL_PREFIX + "step_complete"  # the last request of a trainer step outside a session
CONTROL_NAMES = (STEP_COMPLETE,)

# load_format of a validate-only request: checked on every TP rank, nothing written (the first phase of the
# client's all-or-nothing step)
VALIDATE_ONLY = "fp8rl.validate"

# SGLang's load_format of one flattened tensor with its per-tensor metadata (sglang.srt.weight_sync.tensor_bucket)
FLATTENED_BUCKET = "flattened_bucket"

# load_format of a validate-only request whose tensors travel as one flattened bucket (the first phase of an
# all-or-nothing step sent with flatten=True)
VALIDATE_ONLY_FLATTENED = VALIDATE_ONLY + "." + FLATTENED_BUCKET
VALIDATE_FORMATS = (VALIDATE_ONLY, VALIDATE_ONLY_FLATTENED)
FLATTENED_FORMATS = (FLATTENED_BUCKET, VALIDATE_ONLY_FLATTENED)  # a request whose tensors are one flattened bucket

# pre-quantized FP8: ``<name>`` as float8_e4m3fn codes travels with ``<name>_scale_inv`` (float32 block scales)
SCALE_SUFFIX = "_scale_inv"


def is_scale_name(name: object) -> bool:
    """Whether ``name`` is a pre-quantized weight's scale (``<...>.weight_scale_inv``)."""
    return isinstance(name, str) and name.endswith(".weight" + SCALE_SUFFIX)


# marks in the engine's answers: the engine's notes (a refusal, a validation, a step ended incomplete) start with
# ANSWER_MARK (the client logs a session's begin answer that carries one: what the engine dropped of a step left open);
# every answer given while the engine is inconsistent holds INCONSISTENT_MARK (the HTTP process reads it:
# hooks/tokenizer.py holds /health at 503 meanwhile)
ANSWER_MARK = "[fp8rl]"
INCONSISTENT_MARK = "[fp8rl: engine inconsistent]"
