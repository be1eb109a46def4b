"""A folder on an object store (``s3://``, ``gs://``, ``oci://``, ``azure://``): upload, list, download, delete.

Uploads and downloads go through mosaicml-streaming's own uploaders and downloaders, so credentials
and endpoints come from where streaming and the SDKs look for them (``AWS_*`` variables and
``~/.aws``, ``S3_ENDPOINT_URL`` for S3-compatible stores, ``GOOGLE_APPLICATION_CREDENTIALS``,
``~/.oci/config``, ``AZURE_ACCOUNT_NAME``/``AZURE_ACCOUNT_ACCESS_KEY``); foundry never reads, logs
or stores them. Listing and deleting use the SDK client the uploader already holds. Keys are
relative to the folder's URL: ``ep0-ba4/manifest.json``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from foundry.core.paths import OBJECT_STORE_EXTRAS, url_scheme
from foundry.errors import CheckpointError
from foundry.optional import import_optional

# The SDK module each scheme's streaming uploader imports, as the optional extra installs it.
_SDK_MODULES = {"s3": "boto3", "gs": "google.cloud.storage", "oci": "oci", "azure": "azure.storage.blob"}
_DOWNLOAD_TIMEOUT_S = 600.0

log = logging.getLogger(__name__)


@functools.cache
def object_store(url: str) -> ObjectStore:
    """The ``ObjectStore`` of ``url``, made once per process (its SDK clients take a while to create)."""
    return ObjectStore(url)


class ObjectStore:
    """The object-store folder ``url``; raises ``CheckpointError`` when its SDK or bucket cannot be reached."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.scheme = url_scheme(url) or ""
        if self.scheme not in OBJECT_STORE_EXTRAS:
            raise CheckpointError(f"{url} is not an object-store URL ({', '.join(OBJECT_STORE_EXTRAS)}).")
        extra = OBJECT_STORE_EXTRAS[self.scheme]
        import_optional(
            _SDK_MODULES[self.scheme],
            needed_for=f"A checkpoint folder on {self.scheme}:// ({url})",
            package=f"the {self.scheme}:// SDK",
            install=f"pip install 'foundry[{extra}]'",
            error=CheckpointError,
        )
        # mosaicml-streaming is imported here, not at the top: foundry imports without it (the GPU image lacks it).
        streaming = {
            name: import_optional(
                f"streaming.base.storage.{name}",
                needed_for=f"A checkpoint folder on {self.scheme}:// ({url})",
                package="the mosaicml-streaming package",
                install="pip install mosaicml-streaming",
                error=CheckpointError,
            )
            for name in ("upload", "download")
        }
        self.upload_retries, self.upload_backoff_s = 0, 0.0  # set by the run that saves here
        self._lock = threading.Lock()  # streaming's uploader uploads from one (local, remote) pair at a time
        with self.errors("reach"):
            staging = tempfile.mkdtemp(prefix="foundry-upload-")
            self._uploader = streaming["upload"].CloudUploader.get((staging, self.url), keep_local=True, retry=1)
        # It keeps its SDK client: creating one takes a while.
        self._downloader = streaming["download"].CloudDownloader.get(self.url)

    def __repr__(self) -> str:
        return f"ObjectStore({self.url})"

    def url_of(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    # ------------------------------------------------------------------------------------ transfer
    def upload(self, local_file: Path, key: str) -> None:
        """Upload ``local_file`` as ``key`` (whose last part must be the file's name), replacing any object there.

        A failure is retried ``upload_retries`` times, waiting ``upload_backoff_s`` seconds, then twice as long
        each time; the last one raises ``CheckpointError``.
        """
        folder, _, name = key.rpartition("/")
        if name != local_file.name:
            raise ValueError(f"upload key {key} must end in the file's name {local_file.name}")
        wait_s = self.upload_backoff_s
        for retry in range(self.upload_retries + 1):
            try:
                with self._lock, self.errors(f"upload {local_file} to", key):
                    # Streaming's uploaders upload <local>/<name> to <remote>/<name>.
                    self._uploader.local, self._uploader.remote = str(local_file.parent), self.url_of(folder)
                    self._uploader.upload_file(name)
                return
            except CheckpointError as error:
                if retry == self.upload_retries:
                    raise
                log.warning("%s Retrying in %.0f s (retry %d of %d).", error, wait_s, retry + 1, self.upload_retries)
                time.sleep(wait_s)
                wait_s *= 2

    def download(self, key: str, local_file: Path) -> None:
        """Download ``key`` to ``local_file`` (through a temporary name, so a kill leaves no partial file there)."""
        local_file.parent.mkdir(parents=True, exist_ok=True)
        partial = local_file.with_name(f".tmp-{local_file.name}-{secrets.token_hex(4)}")
        try:
            with self._lock, self.errors("download", key):
                self._downloader.download(self.url_of(key), str(partial), _DOWNLOAD_TIMEOUT_S)
            os.replace(partial, local_file)
        finally:
            partial.unlink(missing_ok=True)

    def read_bytes(self, key: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="foundry-read-") as folder:
            path = Path(folder) / key.rpartition("/")[2]
            self.download(key, path)
            return path.read_bytes()

    # ---------------------------------------------------------------------------------- list, delete
    def list(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` (a folder: ``ep0-ba4/``), relative to this folder."""
        base = urllib.parse.urlparse(self.url).path.strip("/")
        with self._lock, self.errors("list", prefix):
            self._uploader.remote = self.url
            if self.scheme == "azure":
                container = self._uploader.azure_service.get_container_client(urllib.parse.urlparse(self.url).netloc)
                full_keys = [blob.name for blob in container.list_blobs(name_starts_with=_join(base, prefix))]
            else:
                full_keys = self._uploader.list_objects(prefix) or []
        return [key[len(base) :].lstrip("/") if base else key for key in full_keys]

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (one request each, in the order given)."""
        parsed = urllib.parse.urlparse(self.url)
        base = parsed.path.strip("/")
        for key in keys:
            with self._lock, self.errors("delete", key):
                _DELETERS[self.scheme](self._uploader, parsed.netloc, _join(base, key))

    @contextlib.contextmanager
    def errors(self, action: str, key: str = "") -> Iterator[None]:
        """Turn an SDK's failure into a ``CheckpointError`` naming the URL and what to check."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as error:
            raise CheckpointError(
                f"Could not {action} {self.url_of(key)} ({type(error).__name__}: {str(error)[:300]}). Check that the "
                f"bucket exists and that this machine's credentials for {self.scheme}:// may read and write it (they "
                "come from the environment or the SDK's own config files); for an S3-compatible store, set "
                "S3_ENDPOINT_URL."
            ) from error


def _join(base: str, key: str) -> str:
    return f"{base}/{key}" if base else key


def _delete_s3(uploader: Any, bucket: str, key: str) -> None:
    uploader.s3.delete_object(Bucket=bucket, Key=key)


def _delete_gs(uploader: Any, bucket: str, key: str) -> None:
    if hasattr(uploader.gcs_client, "delete_object"):  # HMAC keys: a boto3 client on GCS's S3 API
        uploader.gcs_client.delete_object(Bucket=bucket, Key=key)
    else:
        uploader.gcs_client.bucket(bucket).blob(key).delete()


def _delete_oci(uploader: Any, bucket: str, key: str) -> None:
    bucket_name = bucket.split("@")[0]
    uploader.client.delete_object(namespace_name=uploader.namespace, bucket_name=bucket_name, object_name=key)


def _delete_azure(uploader: Any, container: str, key: str) -> None:
    uploader.azure_service.get_container_client(container).delete_blob(key)


_DELETERS = {"s3": _delete_s3, "gs": _delete_gs, "oci": _delete_oci, "azure": _delete_azure}
