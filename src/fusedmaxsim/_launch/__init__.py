"""The launchers: execute the planner's plans on the Triton and Gluon kernels.

``runtime`` holds what every launch shares (the cached launch path, constants, allocation);
``forward`` and ``backward`` execute a ``ForwardPlan`` / ``BackwardPlan`` of every layout,
``approx`` an ``ApproxPlan`` (PLAID's approximate score), ``probe`` a ``ProbePlan`` (the PLAID
search's probe). They compute strides and grids and allocate; every decision was made by
``fusedmaxsim._plan``.
"""
