"""The wire protocol between a trainer and an engine served with `fp8_online_blockwise`: every name that one side
writes and the other reads, defined once here. Imports nothing, so that either side (and a script) may use it.

Names that are SGLang's, not ours, stay with the code that speaks to SGLang: the load format ``flattened_bucket``
(hooks/weight_updater.py), the session routes and SGLang's "already open" refusal (weight_sync/session.py).
"""

# control entries: (name, tensor) items of an update request that carry no weights
CONTROL_PREFIX = "fp8rl."  # a weight name never starts with it; an unknown control name is refused
STEP_COMPLETE = CONTROL_PREFIX + "step_complete"  # the last request of a trainer step outside a session
CONTROL_NAMES = (STEP_COMPLETE,)

# load_format of a validate-only request: checked on every TP rank, nothing written (the first phase of the
# client's all-or-nothing step)
VALIDATE_ONLY = "fp8rl.validate"

# pre-quantized FP8: ``<name>`` as float8_e4m3fn codes travels with ``<name>_scale_inv`` (float32 block scales)
SCALE_SUFFIX = "_scale_inv"

# marks in the engine's answers: the engine's notes (a refusal, a validation, a step ended incomplete) start with
# ANSWER_MARK (the client logs a session's begin answer that carries one: what the engine dropped of a step left open);
# every answer given while the engine is inconsistent holds INCONSISTENT_MARK (the HTTP process reads it:
# hooks/tokenizer.py holds /health at 503 meanwhile)
ANSWER_MARK = "[fp8rl]"
INCONSISTENT_MARK = "[fp8rl: engine inconsistent]"
