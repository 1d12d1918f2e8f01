"""Typed errors.  Every error says what was wrong and where, so a user can act on it."""


class GAACError(Exception):
    """Base class of every error gaac raises on purpose."""


class InputError(GAACError, ValueError):
    """An input array has the wrong shape, dtype or device."""


class FormatError(GAACError, ValueError):
    """A byte stream is not a valid GAAC stream: corrupt, truncated, or of an unknown version."""


class CalibrationError(GAACError, ValueError):
    """A calibration is malformed, or does not match the model or stream it is used with."""


class PoolExhaustedError(GAACError, RuntimeError):
    """A slot pool, raw-tile pool, block table or sequence table of a paged cache is full.

    Raised before anything is written: the cache is unchanged and the caller may
    free sequences and retry.
    """
