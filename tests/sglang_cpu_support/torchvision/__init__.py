"""IMPORT-ONLY STAND-IN for ``torchvision``, for the real SGLang 0.5.23 server on a CPU in tests.

PyPI's torchvision cannot load under the CPU build of torch (its ``_C`` links libtorch_cuda), yet the text-only
server imports it at start-up, through:
  * ``from torchvision.transforms import InterpolationMode`` and ``... import functional as TF``
    (sglang/srt/configs/deepseek_ocr.py, imported by sglang/srt/configs/__init__.py), and then
  * transformers' image utilities, which import ``torchvision.transforms.InterpolationMode``,
    ``torchvision.transforms.functional.pil_to_tensor`` and ``torchvision.transforms.v2.functional`` once they see
    a ``torchvision`` package (transformers/image_utils.py, image_processing_utils.py, image_processing_backends.py,
    video_processing_utils.py).
Nothing is implemented: every function raises NotImplementedError when called (no image is ever processed by a
text model). This folder goes on the PYTHONPATH of the SERVER process only (``rollout.sglang.pythonpath``); never
on GPU, never in the trainer.
"""

__version__ = "0.0.0+standin"


def _stub_module_getattr(module: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def stub(*args, **kwargs):
            raise NotImplementedError(f"{module}.{name}: torchvision is an import-only stand-in in this server process")

        stub.__name__ = name
        return stub

    return __getattr__
