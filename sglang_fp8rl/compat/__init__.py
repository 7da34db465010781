"""Every difference between the SGLang releases this package supports, in one place.

:mod:`.versions` says which releases are supported and checks the installed one before anything imports SGLang's
internals. Each later difference is one named adapter with the release where it starts and why it exists.
"""
