"""The shared-space arm (five architectures, one space): relative depth, probe-level agreement with permutation
nulls, GPA against pairwise maps, domain transfer, routing; ``embed`` puts new text into a fitted space."""

from mergescope.shared_space.agreement import agreement, nn_match, rsa
from mergescope.shared_space.depth import DEFAULT_DEPTHS, depth_layers, layer_at
from mergescope.shared_space.evaluate import Space, fit_space, retrieval_matrices
from mergescope.shared_space.gpa import gpa, pca_reduce
from mergescope.shared_space.space import embed, load_space, save_space

__all__ = ["DEFAULT_DEPTHS", "Space", "agreement", "depth_layers", "embed", "fit_space", "gpa", "layer_at",
           "load_space", "nn_match", "pca_reduce", "retrieval_matrices", "rsa", "save_space"]
