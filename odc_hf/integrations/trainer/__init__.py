"""The transformers Trainer with ODC: the mixin and its parts (arguments, bundles of microbatches, data checks, step
statistics, observability, the failure guard)."""
