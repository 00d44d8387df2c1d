#!/usr/bin/env bash
# Install the real services the tests start (PostgreSQL; headless Chromium and its driver for
# the dashboard tests; Ceph's monitor, manager, OSD and radosgw for the cluster tests, see
# docs/storage.md; Slurm's daemons and munge for the Slurm tests; all from Debian's packages)
# when they are missing. The tests start and stop their own servers; this only makes the
# binaries present.
# Idempotent and quick when everything is installed.
set -euo pipefail
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing PostgreSQL (Debian package postgresql) for the catalog tests" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -q postgresql >/dev/null; }
  else
    echo "PostgreSQL is not installed and cannot be installed here (need root and apt-get):" \
         "the PostgreSQL tests will fail; install the 'postgresql' package" >&2
  fi
fi
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing Chromium and ChromeDriver (Debian packages) for the dashboard tests" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -q chromium chromium-driver >/dev/null; }
  else
    echo "Chromium is not installed and cannot be installed here (need root and apt-get):" \
         "the dashboard tests will fail; install 'chromium' and 'chromium-driver'" >&2
  fi
fi
if ! command -v radosgw >/dev/null || ! command -v ceph-osd >/dev/null \
   || ! command -v ceph-mgr >/dev/null || ! command -v ceph-mon >/dev/null; then
  ceph=(ceph-mon ceph-mgr ceph-osd radosgw ceph-common)
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing Ceph (Debian packages ${ceph[*]}) for the cluster tests" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${ceph[@]}" \
      >/dev/null || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q --no-install-recommends "${ceph[@]}" >/dev/null; }
  else
    echo "Ceph is not installed and cannot be installed here (need root and apt-get):" \
         "the cluster tests will be skipped; install ${ceph[*]}" >&2
  fi
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
   || ! command -v munged >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing Slurm (Debian packages slurm-wlm, munge) for the Slurm tests" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm \
      munge >/dev/null || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null; }
  else
    echo "Slurm is not installed and cannot be installed here (need root and apt-get):" \
         "the Slurm tests will be skipped; install slurm-wlm and munge" >&2
  fi
fi
