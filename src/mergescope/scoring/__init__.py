"""Services every route shares, below the arms: the NLL definition and bits per byte (:mod:`.bpb`), batching
(:mod:`.batching`), saving a model (:mod:`.save`) and lm-eval scoring (:mod:`.lmeval`). Nothing here imports an arm."""
