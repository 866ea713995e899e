"""What a build bakes in: the static spec of one kernel build (spec: KernelSpec, read by the
device code), its derivation from a model and a batch (model_spec: make_spec, the default build)
and the record fields the device code reads (fields). The layer kinds declare their part of it.
"""
