"""Every difference between the SGLang releases this package supports, in one place.

:mod:`.versions` says which releases are supported and checks the installed one before anything imports SGLang's
internals. Each later difference is one named adapter with the release where it starts and why it exists:
:mod:`.updates` (the weight-update entry points, sessions, payloads), :mod:`.runtime` (model runner, server args,
requests, layers, CUDA graphs), :mod:`.kv_pool` (the KV pool's writes). Nothing outside this package tells releases
apart (tests/test_package_structure.py).
"""
