"""Stand-in ``torchvision.transforms.functional``: every name (e.g. ``pil_to_tensor``) is a stub that raises."""

from torchvision import _stub_module_getattr

__getattr__ = _stub_module_getattr("torchvision.transforms.functional")
