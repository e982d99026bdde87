#!/usr/bin/python3
"""oci-image.py OUT NAME ROOT ENTRYPOINT-JSON: a one-layer OCI image archive (oci-layout,
index.json naming the image NAME) of the directory ROOT, for `ctr images import`: the test bed's
images, made from local files with no registry and no image builder. The layer is uncompressed
(containerd takes it as is; compressing 100 MB of binaries would cost seconds a build) and
reproducible: owners root, times zero, entries sorted."""

import hashlib
import io
import json
import os
import sys
import tarfile


def main(out, name, root, entrypoint):
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for entry in [dirpath] + [os.path.join(dirpath, f) for f in sorted(filenames)]:
                arcname = os.path.relpath(entry, root)
                info = tar.gettarinfo(entry, arcname=arcname)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                if info.isfile():
                    with open(entry, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
            # Symbolic links to directories are walked as links, not followed.
            for d in list(dirnames):
                if os.path.islink(os.path.join(dirpath, d)):
                    dirnames.remove(d)
                    info = tar.gettarinfo(os.path.join(dirpath, d), arcname=os.path.relpath(os.path.join(dirpath, d), root))
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    info.mtime = 0
                    tar.addfile(info)
    layer = layer.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()

    with tarfile.open(out, "w") as archive:
        def blob(data, media_type):
            digest = hashlib.sha256(data).hexdigest()
            info = tarfile.TarInfo(f"blobs/sha256/{digest}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
            return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}

        def file(path, data):
            info = tarfile.TarInfo(path)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))

        layer_desc = blob(layer, "application/vnd.oci.image.layer.v1.tar")
        config = {
            "architecture": "amd64",
            "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "config": {"Entrypoint": json.loads(entrypoint),
                       "Env": ["PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
        }
        config_desc = blob(json.dumps(config, sort_keys=True).encode(),
                           "application/vnd.oci.image.config.v1+json")
        manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": config_desc, "layers": [layer_desc]}
        manifest_desc = blob(json.dumps(manifest, sort_keys=True).encode(),
                             "application/vnd.oci.image.manifest.v1+json")
        manifest_desc["annotations"] = {"io.containerd.image.name": name,
                                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]}
        file("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        file("index.json", json.dumps({"schemaVersion": 2, "manifests": [manifest_desc]}).encode())


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    main(*sys.argv[1:])
