"""How many bytes of the text each token stands for (eval's bits per byte): from a tokenizer's character
offsets, each token counted the bytes its span adds, so a text's counts sum to its UTF-8 length.
"""

import numpy as np


def char_widths(text: str) -> np.ndarray:
    """Each character's UTF-8 length."""
    points = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), np.uint32)
    return (1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)).astype(np.int64)


def of_offsets(text: str, char_ends: np.ndarray) -> np.ndarray:
    """Byte counts from character end offsets (Hugging Face offsets are in characters)."""
    data = text.encode("utf-8", errors="surrogatepass")
    if len(data) != len(text) and len(char_ends):  # not ASCII: character offsets -> byte offsets
        char_ends = np.concatenate([[0], np.cumsum(char_widths(text))])[np.clip(char_ends, 0, len(text))]
    return rises(char_ends, len(data))


def rises(ends: np.ndarray, total: int) -> np.ndarray:
    """Each token's new bytes: the rise of the running maximum of its end offset; what no token's span
    reaches (trailing text a normaliser dropped) goes to the last token, so the sum is `total`."""
    if not len(ends):
        return np.zeros(0, np.uint16)
    reach = np.maximum.accumulate(np.clip(ends, 0, total))
    counts = np.diff(reach, prepend=0)
    counts[-1] += total - reach[-1]
    return np.minimum(counts, np.iinfo(np.uint16).max).astype(np.uint16)
