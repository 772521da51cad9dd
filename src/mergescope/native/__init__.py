"""The native weight-space arm: pairs that share a parameter space (checkpoints of one run;
same-architecture models). ``weights``: coverage, routes, weight and task-vector diagnostics;
``pair``: the pair loaded once and its LMC curve; ``merges``: merged-model runs; ``job``: task=native."""
