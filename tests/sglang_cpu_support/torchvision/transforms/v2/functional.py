"""Stand-in ``torchvision.transforms.v2.functional``: every name is a stub that raises."""

from torchvision import _stub_module_getattr

__getattr__ = _stub_module_getattr("torchvision.transforms.v2.functional")
