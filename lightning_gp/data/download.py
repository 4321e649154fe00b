"""Fetching dataset files over HTTP(S) with md5 verification, and safe tar extraction."""

import hashlib
import os
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

#: Seconds to wait for a connection or for the next chunk of a response.
DOWNLOAD_TIMEOUT_S = 30.0
_CHUNK = 1 << 20


class DownloadError(RuntimeError):
    """A download failed: unreachable server, HTTP error, or checksum mismatch."""


def file_md5(path: Path) -> str:
    """Hex md5 of a file, read in chunks."""
    digest = hashlib.md5()  # integrity check against the official checksums, not security
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(url: str, dest: Path, md5: str | None = None, timeout: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """Download ``url`` to ``dest`` (through a ``.part`` file) and check its md5 when given."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, part.open("wb") as out:
            for chunk in iter(lambda: response.read(_CHUNK), b""):
                out.write(chunk)
    except (urllib.error.URLError, OSError, ValueError) as exc:  # ValueError: malformed URL
        part.unlink(missing_ok=True)
        raise DownloadError(f"could not download {url}: {getattr(exc, 'reason', exc)}") from exc
    if md5 is not None and (actual := file_md5(part)) != md5:
        part.unlink()
        raise DownloadError(f"{url}: md5 {actual} does not match the expected {md5}")
    os.replace(part, dest)
    return dest


def extract_tar(archive: Path, dest: Path) -> None:
    """Extract a (compressed) tar archive into ``dest``, refusing members that would land outside it."""
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4 / 3.12
            tar.extractall(dest, filter="data")
            return
        root = dest.resolve()
        for member in tar.getmembers():
            target = (root / member.name).resolve()
            if (target != root and root not in target.parents) or member.issym() or member.islnk():
                raise DownloadError(f"{archive}: unsafe archive member {member.name!r}")
        tar.extractall(dest)
