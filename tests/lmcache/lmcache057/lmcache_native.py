# Stand-in for LMCache's compiled extension `lmcache.lmcache_native` (C++ in csrc/lmcache_native/),
# which the pure-Python wheel lmcache-cli==0.5.7rc3.dev0 does not ship. It is NOT an implementation:
# the enums are copied value for value from the wheel's lmcache/lmcache_native.pyi (they are needed at
# import time: EngineKVFormat and TransferDirection are used in annotations, defaults and dict keys);
# every other function, method and constructor raises NotImplementedError naming itself, so any
# code path that really needs the native code fails loudly instead of computing something wrong.
# Exceptions, each needed by rc3's client on its CPU engine_driven path: the descriptor struct
# PageBufferShapeDesc (data only) and the five layout predicates (is_kv_list ... is_kv_second_tuple).
from enum import IntEnum


def _missing(name):
    raise NotImplementedError(
        f"lmcache.lmcache_native.{name}: native extension not available "
        "(stand-in for lmcache-cli 0.5.7rc3.dev0)"
    )


class EngineKVFormat(IntEnum):
    NB_NL_TWO_BS_NH_HS = 0
    NL_X_TWO_NB_BS_NH_HS = 1
    NL_X_NB_TWO_BS_NH_HS = 2
    NL_X_NB_BS_HS = 3
    TWO_X_NL_X_NBBS_NH_HS = 4
    NL_X_NBBS_ONE_HS = 5
    NL_X_TWO_NB_NH_BS_HS = 6
    NL_X_NB_TWO_NH_BS_HS = 7
    NB_NL_TWO_NH_BS_HS = 8
    TWO_X_NL_X_NB_BS_NH_HS = 9
    NL_X_NB_NH_BS_TWO_HS = 10
    NL_X_NB_BS_NH_TWO_HS = 11
    NL_X_NB_NH_BS_CS = 12
    NL_X_NB_BS_NH_CS = 13
    NL_X_NB_BSV_BSS = 14
    NL_X_TWO_NB_NH_ONE_BS_HS = 15
    NL_X_TWO_X_NB_BS_NH_HS = 16
    NL_X_NP_X_NB_BS_ONE_HS = 17
    NL_X_NB_BS_NH_HS = 18
    NL_X_NB_TWO_NH_ONE_BS_HS = 19


GPUKVFormat = EngineKVFormat  # backward-compat alias, as in the .pyi


class TransferDirection(IntEnum):
    H2D = 0
    D2H = 1


class _Missing:
    """Base of the stand-in classes: constructing one raises."""

    def __init__(self, *args, **kwargs):
        _missing(f"{type(self).__name__}.__init__")


class PageBufferShapeDesc:
    """A plain descriptor struct, not code: rc3's CPU engine_driven store/retrieve path builds one
    (gpu_connector/utils.py::make_page_buffer_shape_desc) and hands it to the pure-torch
    transfer (platform/torch_ops). Fields as in the .pyi, zero-initialised and open to extra
    attributes (`dtype` is set from Python), as the compiled 0.5.6 class behaves."""

    def __init__(self) -> None:
        self.kv_size = self.nl = self.nb = self.bs = self.nh = self.hs = 0
        self.element_size = self.block_stride_elems = 0


class KernelGroupSpec(_Missing):
    pass


class TTLLock(_Missing):
    pass


class Bitmap(_Missing):
    pass


class ParallelPatternMatcher(_Missing):
    pass


class RangePatternMatcher(_Missing):
    pass


class PeriodicEventNotifier(_Missing):
    @staticmethod
    def create(interval_ms, use_eventfd):
        _missing("PeriodicEventNotifier.create")

    @staticmethod
    def get():
        _missing("PeriodicEventNotifier.get")

    @staticmethod
    def shutdown():
        _missing("PeriodicEventNotifier.shutdown")


# The layout predicates are the second exception to "raise". On its CPU engine_driven store and
# retrieve path rc3's client calls is_cross_layer, is_kv_list and is_kv_second_tuple
# (gpu_connector/utils.py::_pick_layout_probe_tensor) and is_mla (make_page_buffer_shape_desc).
# They are static facts of each format, and rc3 declares the same facts in pure Python as class
# attributes of its KVFormatSpec classes (v1/gpu_connector/kv_format/specs/*.py), so the stand-in
# reads them from there. For formats 0-18 the answers equal those of LMCache 0.5.6's compiled
# lmcache_native (all 19 x 5 values compared); 0.5.6 has no format 19.
def _spec_fact(format, fact):
    from lmcache.v1.gpu_connector.kv_format.specs.registry import get_spec_class

    return bool(getattr(get_spec_class(format), fact))


def is_kv_list(format):
    return _spec_fact(format, "is_kv_list")


def is_layer_list(format):
    return _spec_fact(format, "is_layer_list")


def is_cross_layer(format):
    return _spec_fact(format, "is_cross_layer")


def is_mla(format):
    return _spec_fact(format, "is_mla")


def is_kv_second_tuple(format):
    return _spec_fact(format, "is_kv_second_tuple")


def fold(found, num_chunks, num_ranks, group_windows):
    _missing("fold")


def unfold(hit_length, num_chunks, num_ranks, group_windows):
    _missing("unfold")


def fold_grouped(rows, windows):
    _missing("fold_grouped")


def unfold_grouped(hit_length, num_chunks, windows):
    _missing("unfold_grouped")
