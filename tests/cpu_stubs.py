"""Import-time stubs so real SGLang modules import on a CPU-only CI machine.
Only torchvision is stubbed: PyPI's torchvision wheels are CUDA builds whose
_C.so needs libtorch_cuda.so. SGLang imports it at module level
(sglang.srt.utils.common: `from torchvision.io import decode_jpeg`;
sglang.srt.configs.deepseek_ocr: InterpolationMode / transforms.functional).
Call install_cpu_stubs() before the first `import sglang`."""
import enum, importlib.machinery, sys, types

class _FnModule(types.ModuleType):
    """Module whose unknown public attributes are functions raising NotImplementedError."""
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        def _unavailable(*args, **kwargs):
            raise NotImplementedError(f"{self.__name__}.{name} is a CPU-CI stub")
        _unavailable.__name__ = name
        return _unavailable

def _mod(name, cls=types.ModuleType, is_pkg=True):
    m = cls(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=is_pkg)
    if is_pkg:
        m.__path__ = []
    m.__file__ = __file__
    sys.modules[name] = m
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, m)
    return m

def _install_torchvision_stub():
    if "torchvision" in sys.modules:
        return
    try:  # a working torchvision (CPU build) wins
        import torchvision  # noqa: F401
        return
    except (ImportError, RuntimeError, OSError):  # CUDA-only build on a CPU machine
        for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[k]
    # NB: transformers 5.x sees this stub as "torchvision available" (find_spec). That is
    # required: its AutoImageProcessor refuses to work without torchvision, and
    # sglang.srt.configs registers image processors at import time.
    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"; NEAREST_EXACT = "nearest-exact"; BILINEAR = "bilinear"
        BICUBIC = "bicubic"; BOX = "box"; HAMMING = "hamming"; LANCZOS = "lanczos"
    class ImageReadMode(enum.Enum):
        UNCHANGED = 0; GRAY = 1; GRAY_ALPHA = 2; RGB = 3; RGB_ALPHA = 4
    tv = _mod("torchvision"); tv.__version__ = "0.28.0+cpustub"
    io = _mod("torchvision.io", _FnModule, is_pkg=False); io.ImageReadMode = ImageReadMode
    tr = _mod("torchvision.transforms", _FnModule); tr.InterpolationMode = InterpolationMode
    f = _mod("torchvision.transforms.functional", _FnModule, is_pkg=False); f.InterpolationMode = InterpolationMode
    _mod("torchvision.transforms.v2", _FnModule)
    v2f = _mod("torchvision.transforms.v2.functional", _FnModule, is_pkg=False); v2f.InterpolationMode = InterpolationMode

def install_cpu_stubs():
    _install_torchvision_stub()
