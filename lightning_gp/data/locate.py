"""Finding a dataset's files on disk (or downloading them when asked), with helpful errors."""

import os
from dataclasses import dataclass
from pathlib import Path

from lightning_gp.data.base import DatasetNotFoundError
from lightning_gp.data.download import DownloadError, extract_tar, fetch

#: Root folder searched when no ``data_dir`` is given: ``$LIGHTNING_GP_DATA_DIR/<dataset folder>``.
DATA_DIR_ENV = "LIGHTNING_GP_DATA_DIR"


@dataclass(frozen=True)
class RemoteFile:
    """A file published at ``<mirror>/<name>``; archives are extracted into the data directory."""

    name: str
    md5: str | None
    archive: bool = False


@dataclass(frozen=True)
class DatasetFiles:
    """Where a dataset's files live and where they come from.

    Attributes:
        title: Human-readable dataset name for messages.
        files: Required files; each entry lists the accepted names, canonical name first.
        folder: Sub-folder of ``$LIGHTNING_GP_DATA_DIR`` used when no ``data_dir`` is given.
        mirror: Default base URL of ``remote``.
        remote: What ``download=True`` fetches.
        how_to_get: Sentence telling users how to obtain the files by hand.
        layouts: Sub-folders of a data directory searched, in order ("" is the directory itself).
        system_dirs: Extra directories searched when no ``data_dir`` is given.
    """

    title: str
    files: tuple[tuple[str, ...], ...]
    folder: str
    mirror: str
    remote: tuple[RemoteFile, ...]
    how_to_get: str
    layouts: tuple[str, ...] = ("",)
    system_dirs: tuple[str, ...] = ()

    def expected(self) -> str:
        return ", ".join(names[0] + "".join(f" (or {n})" for n in names[1:]) for names in self.files)


def locate_files(
    spec: DatasetFiles, data_dir: str | None, download: bool = False, mirror: str | None = None
) -> dict[str, Path]:
    """Map each canonical file name of ``spec`` to its path, downloading first if allowed and needed.

    Raises:
        DatasetNotFoundError: The files are missing and ``download`` is false.
        DownloadError: (a RuntimeError) ``download`` is true and the download failed.
    """
    candidates = _candidates(spec, data_dir)
    found, report = _search(spec, candidates)
    if found is not None:
        return found
    if not download:
        raise DatasetNotFoundError(_not_found_message(spec, report))
    target = _download_dir(spec, data_dir)
    _download(spec, target, mirror or spec.mirror)
    found, report = _search(spec, [target / layout for layout in spec.layouts])
    if found is None:
        raise DatasetNotFoundError(_not_found_message(spec, report) + " (after downloading)")
    return found


def _candidates(spec: DatasetFiles, data_dir: str | None) -> list[Path]:
    if data_dir is not None:
        roots = [Path(data_dir).expanduser()]
    else:
        env = os.environ.get(DATA_DIR_ENV)
        roots = ([Path(env).expanduser() / spec.folder] if env else []) + [Path(d) for d in spec.system_dirs]
    return [root / layout if layout else root for root in roots for layout in spec.layouts]


def _search(spec: DatasetFiles, candidates: list[Path]) -> tuple[dict[str, Path] | None, list[str]]:
    report = []
    for directory in candidates:
        if not directory.is_dir():
            report.append(f"{directory} (no such directory)")
            continue
        found = {
            names[0]: next((directory / n for n in names if (directory / n).is_file()), None) for names in spec.files
        }
        missing = [name for name, path in found.items() if path is None]
        if not missing:
            return {name: path for name, path in found.items() if path is not None}, report
        report.append(f"{directory} (missing: {', '.join(missing)})")
    return None, report


def _not_found_message(spec: DatasetFiles, report: list[str]) -> str:
    searched = "; ".join(report) if report else f"nothing (no data_dir given and ${DATA_DIR_ENV} is not set)"
    return f"{spec.title} not found. Searched: {searched}. Expected files: {spec.expected()}. {spec.how_to_get}"


def _download_dir(spec: DatasetFiles, data_dir: str | None) -> Path:
    if data_dir is not None:
        return Path(data_dir).expanduser()
    if env := os.environ.get(DATA_DIR_ENV):
        return Path(env).expanduser() / spec.folder
    raise ValueError(f"download=True needs a data_dir (or ${DATA_DIR_ENV}) to download {spec.title} into")


def _download(spec: DatasetFiles, target: Path, mirror: str) -> None:
    base = mirror.rstrip("/") + "/"
    for remote in spec.remote:
        dest = target / remote.name
        if dest.is_file() and not remote.archive:
            continue
        try:
            fetch(base + remote.name, dest, remote.md5)
            if remote.archive:
                extract_tar(dest, target)
                dest.unlink()
        except DownloadError as exc:
            raise DownloadError(
                f"Downloading {spec.title} from {base} failed: {exc}. To use it offline, place the files "
                f"by hand in {target}: {spec.expected()}. {spec.how_to_get}"
            ) from exc
