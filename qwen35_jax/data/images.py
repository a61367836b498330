"""Images -> the vision tower's flattened patches and (t, h, w) grids, on the host, as transformers does it.

`ImageProcessor` wraps transformers' `Qwen2VLImageProcessorPil`, the image processor Qwen3.5 checkpoints
name (`Qwen2VLImageProcessor`) in its PIL/NumPy form, so torchvision is never needed. transformers 5.25
without torchvision resolves `AutoImageProcessor.from_pretrained` of a Qwen3.5 checkpoint to that class
already; with torchvision installed it would pick the torchvision-backed class, whose resize differs in
the last bits, so the settings are always copied into the PIL class: the same pixels everywhere.

Each image is resized (bicubic) to the nearest size whose sides are multiples of patch_size * merge_size
and whose area lies in [min_pixels, max_pixels] (`smart_resize`), rescaled to [0, 1], normalized by
mean/std, repeated over temporal_patch_size frames and cut into patches, in merge-window order
(row-major over windows, row-major inside each merge_size x merge_size window): the order
`vision.layout` and the tower expect. Patch values are ordered (C, T, p, p): patch_dim values each.

Qwen3.5's preprocessor_config.json (every released size): patch 16, temporal 2, merge 2, mean = std =
(0.5, 0.5, 0.5), size {shortest_edge: 65536, longest_edge: 16777216} (min/max pixels). Not transformers'
Qwen2-VL defaults (CLIP mean/std, 56*56 .. 28*28*1280 pixels): `from_vision_config` uses Qwen3.5's.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from PIL import Image

    from qwen35_jax.vision.config import VisionConfig

QWEN35_MIN_PIXELS = 65536  # preprocessor_config.json size.shortest_edge: 256 patches of 16 x 16
QWEN35_MAX_PIXELS = 16777216  # size.longest_edge: 65536 patches of 16 x 16
QWEN35_IMAGE_MEAN = (0.5, 0.5, 0.5)
QWEN35_IMAGE_STD = (0.5, 0.5, 0.5)
PREPROCESSOR_CONFIG = "preprocessor_config.json"
# The Qwen2VLImageProcessorPil settings a processor is rebuilt from (to_dict() keys).
_SETTINGS = ("do_resize", "resample", "size", "do_rescale", "rescale_factor", "do_normalize", "image_mean",
             "image_std", "do_convert_rgb", "patch_size", "temporal_patch_size", "merge_size")
_LOADING = threading.Lock()  # transformers' lazy imports are not thread-safe (grain maps on threads)


class ImageError(ValueError):
    """An image that cannot be used; the message is one line naming its path."""


def _first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0]


def preprocessor_dir(directories: Sequence[str | None]) -> str | None:
    """The first of `directories` (None entries skipped) that holds a preprocessor_config.json."""
    return next((d for d in directories if d and os.path.isfile(os.path.join(d, PREPROCESSOR_CONFIG))), None)


def resolve_image_path(path: str, base_dir: str | None) -> str:
    """`path` as written in a row: absolute, or relative to `base_dir` (the JSONL file's folder; the
    working directory when None)."""
    if os.path.isabs(path) or base_dir is None:
        return path
    return os.path.join(base_dir, path)


def load_image(path: str, base_dir: str | None = None) -> Image.Image:
    """The RGB image at `path` (absolute or relative to `base_dir`), fully read. Transparency is
    composited onto white, as transformers' `convert_to_rgb` does. ImageError naming the path otherwise."""
    from PIL import Image, UnidentifiedImageError

    full = resolve_image_path(path, base_dir)
    if not os.path.isfile(full):
        raise ImageError(f"image {full}: file not found")
    try:
        with Image.open(full) as image:
            image.load()
            if "A" in image.getbands() or image.info.get("transparency") is not None:
                background = Image.new("RGBA", image.size, (255, 255, 255, 255))
                return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as err:
        raise ImageError(f"image {full}: cannot read it ({_first_line(err)})") from None


def _pil_class() -> type:
    with _LOADING:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil


class ImageProcessor:
    """transformers' Qwen2-VL image processor (PIL backend) with fixed settings.

    Picklable for grain's worker processes: only the settings travel; the transformers object is
    built on first use in each process."""

    def __init__(self, settings: dict[str, Any]):
        self.settings = {k: v for k, v in settings.items() if k in _SETTINGS}
        size = dict(self.settings.get("size") or {})
        for key in ("patch_size", "temporal_patch_size", "merge_size"):
            if not isinstance(self.settings.get(key), int) or self.settings[key] < 1:
                raise ValueError(f"image processor {key} must be an int >= 1, got {self.settings.get(key)!r}")
        if not (isinstance(size.get("shortest_edge"), int) and isinstance(size.get("longest_edge"), int)):
            raise ValueError(f"image processor size needs integer shortest_edge and longest_edge (min and max "
                             f"pixels), got {size}")
        if not 0 < size["shortest_edge"] <= size["longest_edge"]:
            raise ValueError(f"image processor min_pixels {size['shortest_edge']} must be > 0 and <= "
                             f"max_pixels {size['longest_edge']}")
        self.settings["size"] = {"shortest_edge": size["shortest_edge"], "longest_edge": size["longest_edge"]}
        self._hf: Any = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_hf": None}

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_vision_config(cls, config: VisionConfig, *, min_pixels: int | None = None,
                           max_pixels: int | None = None) -> ImageProcessor:
        """Qwen3.5's processor settings (mean/std 0.5, 65536 .. 16777216 pixels) for `config`'s patch,
        temporal and merge sizes; min/max pixels overridden when given."""
        _check_rgb(config)
        return cls({"do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
                    "do_normalize": True, "image_mean": QWEN35_IMAGE_MEAN, "image_std": QWEN35_IMAGE_STD,
                    "do_convert_rgb": True, "patch_size": config.patch_size,
                    "temporal_patch_size": config.temporal_patch_size, "merge_size": config.spatial_merge_size,
                    "size": {"shortest_edge": QWEN35_MIN_PIXELS if min_pixels is None else min_pixels,
                             "longest_edge": QWEN35_MAX_PIXELS if max_pixels is None else max_pixels}})

    @classmethod
    def from_pretrained(cls, directory: str, *, min_pixels: int | None = None, max_pixels: int | None = None,
                        vision: VisionConfig | None = None) -> ImageProcessor:
        """The processor of a checkpoint directory's preprocessor_config.json (through
        `AutoImageProcessor`), its settings in the PIL class; min/max pixels overridden when given;
        checked against the tower's `vision` config when given. One-line ValueError otherwise."""
        path = os.path.join(directory, PREPROCESSOR_CONFIG)
        if not os.path.isfile(path):
            raise ValueError(f"{path}: not found (the checkpoint's image processor settings)")
        try:
            with _LOADING:
                from transformers import AutoImageProcessor

                loaded = AutoImageProcessor.from_pretrained(directory)
        except Exception as err:  # noqa: BLE001  no torchvision, an unknown type...: read the JSON ourselves
            try:
                loaded = _pil_class().from_pretrained(directory)
            except Exception:  # noqa: BLE001
                raise ValueError(f"{path}: cannot load the image processor ({_first_line(err)})") from None
        settings = loaded.to_dict()
        for name in ("patch_size", "temporal_patch_size", "merge_size"):
            if name not in settings:
                raise ValueError(f"{path}: {type(loaded).__name__} has no {name}; a Qwen2-VL image processor "
                                 f"is expected")
        size = dict(settings.get("size") or {})
        size = {"shortest_edge": size.get("shortest_edge", settings.get("min_pixels")),
                "longest_edge": size.get("longest_edge", settings.get("max_pixels"))}
        if min_pixels is not None:
            size["shortest_edge"] = min_pixels
        if max_pixels is not None:
            size["longest_edge"] = max_pixels
        processor = cls({**settings, "size": size})
        if vision is not None:
            processor.check_vision(vision, source=path)
        return processor

    # ------------------------------------------------------------------ settings
    @property
    def patch_size(self) -> int:
        return self.settings["patch_size"]

    @property
    def temporal_patch_size(self) -> int:
        return self.settings["temporal_patch_size"]

    @property
    def merge_size(self) -> int:
        return self.settings["merge_size"]

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: 3 channels * temporal_patch_size * patch_size**2."""
        return 3 * self.temporal_patch_size * self.patch_size ** 2

    @property
    def min_pixels(self) -> int:
        return self.settings["size"]["shortest_edge"]

    @property
    def max_pixels(self) -> int:
        return self.settings["size"]["longest_edge"]

    def check_vision(self, config: VisionConfig, *, source: str = "image processor") -> None:
        """ValueError unless the processor cuts the patches the tower `config` embeds."""
        _check_rgb(config)
        for mine, theirs in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                             ("merge_size", "spatial_merge_size")):
            if self.settings[mine] != getattr(config, theirs):
                raise ValueError(f"{source}: {mine} {self.settings[mine]} does not match the vision tower's "
                                 f"{theirs} {getattr(config, theirs)}")

    def save(self, directory: str) -> str:
        """DIRECTORY/preprocessor_config.json with these settings, as transformers writes it (so that
        `from_pretrained` and transformers' `AutoImageProcessor` read it back), replaced atomically."""
        from qwen35_jax.files import write_text_atomically

        path = os.path.join(directory, PREPROCESSOR_CONFIG)
        write_text_atomically(path, self.hf_processor().to_json_string())
        return path

    def to_json(self) -> str:
        """The settings, for a manifest."""
        return json.dumps({k: (list(v) if isinstance(v, tuple) else v) for k, v in sorted(self.settings.items())},
                          default=int)

    # ------------------------------------------------------------------ processing
    def hf_processor(self) -> Any:
        """The transformers `Qwen2VLImageProcessorPil` with these settings (built once per process)."""
        if self._hf is None:
            self._hf = _pil_class()(**self.settings)
        return self._hf

    def grid_thw(self, height: int, width: int) -> tuple[int, int, int]:
        """The (t, h, w) patch grid an image of height x width pixels becomes (`smart_resize`)."""
        with _LOADING:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        h, w = smart_resize(height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def process(self, images: Sequence[Image.Image]) -> tuple[np.ndarray, np.ndarray]:
        """images -> (patches float32 [P, patch_dim], grids_thw int64 [N, 3]), image after image; P is
        the sum of t * h * w. ImageError (one line) for an image the processor refuses (an aspect
        ratio over 200)."""
        if not images:
            return np.zeros((0, self.patch_dim), np.float32), np.zeros((0, 3), np.int64)
        try:
            out = self.hf_processor()(images=list(images), return_tensors=None)
        except ValueError as err:
            raise ImageError(f"image processor: {_first_line(err)}") from None
        patches = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)  # [P, patch_dim]
        grids = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3)  # [N, 3]
        assert patches.shape == (int(np.prod(grids, axis=1).sum()), self.patch_dim), (patches.shape, grids)
        return patches, grids

    def process_paths(self, paths: Sequence[str], base_dir: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """`load_image` then `process`, each image on its own so an error names its path."""
        patches, grids = [], []
        for path in paths:
            image = load_image(path, base_dir)
            try:
                p, g = self.process([image])
            except ImageError as err:
                raise ImageError(f"image {resolve_image_path(path, base_dir)}: "
                                 f"{str(err).removeprefix('image processor: ')}") from None
            patches.append(p), grids.append(g)
        if not patches:
            return self.process([])
        return np.concatenate(patches), np.concatenate(grids)


def _check_rgb(config: VisionConfig) -> None:
    if config.in_channels != 3:
        raise ValueError(f"the image processor writes RGB patches (3 channels); the vision tower takes "
                         f"{config.in_channels}")
