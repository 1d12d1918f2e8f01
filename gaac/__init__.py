"""gaac: lossless group-adaptive additive coding of BF16 KV caches (format v1)."""
from .block import EncodedBlock, decode_block, encode_block
from .calibration import Calibration, calibrate
from .errors import CalibrationError, FormatError, GAACError, InputError
from .layout import FORMAT_VERSION

__all__ = [
    "Calibration", "CalibrationError", "EncodedBlock", "FORMAT_VERSION", "FormatError", "GAACError",
    "InputError", "calibrate", "decode_block", "encode_block",
]
