"""Mount table lines in the exact shapes the Linux kernel writes them.

mountinfo lines as ``show_mountinfo`` (fs/proc_namespace.c) prints them, with the
super options ``nfs_show_options`` (fs/nfs/super.c) gives an NFS mount; the
mountstats blocks as ``nfs_show_stats`` prints them, whose ``nfsv4:`` line names
the pNFS layout driver (``pnfs=LAYOUT_NFSV4_1_FILES``) or ``pnfs=not configured``.
Mount points are placeholders a test fills in (``{nfs3}``...), so that each names
a real directory of the test.
"""

from __future__ import annotations

MOUNTINFO = """\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw,errors=remount-ro
25 22 0:23 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw,inode64
41 22 259:3 / {ext4} rw,relatime shared:30 - ext4 /dev/nvme1n1 rw
44 22 0:40 / {nfs3} rw,relatime shared:25 - nfs 192.168.1.10:/export/kv rw,vers=3,rsize=1048576,\
wsize=1048576,namlen=255,hard,proto=tcp,timeo=600,retrans=2,sec=sys,mountaddr=192.168.1.10,mountvers=3,\
mountport=20048,mountproto=udp,local_lock=none,addr=192.168.1.10
45 22 0:41 / {nfs41} rw,relatime shared:26 - nfs4 192.168.1.10:/export/kv rw,vers=4.1,rsize=1048576,\
wsize=1048576,namlen=255,hard,proto=tcp,timeo=600,retrans=2,sec=sys,clientaddr=192.168.1.20,\
local_lock=none,addr=192.168.1.10
46 22 0:42 / {pnfs_rdma} rw,relatime shared:27 - nfs4 10.10.0.5:/kvcache rw,vers=4.1,rsize=262144,\
wsize=262144,namlen=255,hard,proto=rdma,port=20049,timeo=600,retrans=2,sec=sys,clientaddr=10.10.0.20,\
local_lock=none,addr=10.10.0.5
47 22 0:43 / {nfs3_rdma} rw,relatime shared:28 - nfs 10.10.0.5:/kvcache rw,vers=3,rsize=1048576,\
wsize=1048576,namlen=255,hard,proto=rdma,port=20049,timeo=600,retrans=2,sec=sys,mountaddr=10.10.0.5,\
mountvers=3,mountproto=tcp,local_lock=none,addr=10.10.0.5
"""

MOUNTSTATS = """\
device /dev/nvme0n1p2 mounted on / with fstype ext4
device tmpfs mounted on /dev/shm with fstype tmpfs
device 192.168.1.10:/export/kv mounted on {nfs3} with fstype nfs statvers=1.1
\topts:\trw,vers=3,rsize=1048576,wsize=1048576,namlen=255,acregmin=3,acregmax=60,hard,proto=tcp
\tage:\t3600
\tcaps:\tcaps=0x3fc7,wtmult=512,dtsize=32768,bsize=0,namlen=255
\tsec:\tflavor=1,pseudoflavor=1
device 192.168.1.10:/export/kv mounted on {nfs41} with fstype nfs4 statvers=1.1
\topts:\trw,vers=4.1,rsize=1048576,wsize=1048576,namlen=255,hard,proto=tcp
\tage:\t3600
\timpl_id:\tname='',domain='',date='0,0'
\tcaps:\tcaps=0x3ffdf,wtmult=512,dtsize=32768,bsize=0,namlen=255
\tnfsv4:\tbm0=0xfdffbfff,bm1=0x40f9be3e,bm2=0x803,acl=0x3,sessions,pnfs=not configured,lease_time=90,\
lease_expired=0
\tsec:\tflavor=1,pseudoflavor=1
device 10.10.0.5:/kvcache mounted on {pnfs_rdma} with fstype nfs4 statvers=1.1
\topts:\trw,vers=4.1,rsize=262144,wsize=262144,namlen=255,hard,proto=rdma,port=20049
\tage:\t3600
\timpl_id:\tname='',domain='',date='0,0'
\tcaps:\tcaps=0x3fffff7,wtmult=512,dtsize=32768,bsize=0,namlen=255
\tnfsv4:\tbm0=0xfdffbfff,bm1=0x40f9be3e,bm2=0x60803,acl=0x3,sessions,pnfs=LAYOUT_NFSV4_1_FILES,\
lease_time=90,lease_expired=0
\tsec:\tflavor=1,pseudoflavor=1
device 10.10.0.5:/kvcache mounted on {nfs3_rdma} with fstype nfs statvers=1.1
\topts:\trw,vers=3,rsize=1048576,wsize=1048576,namlen=255,hard,proto=rdma,port=20049
\tage:\t3600
"""

MOUNT_NAMES = ("ext4", "nfs3", "nfs41", "pnfs_rdma", "nfs3_rdma")


def mangle(path: str) -> str:
    """A path as the kernel writes it in both files: space, tab, newline, backslash octal-escaped."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in path)


def mount_files(points: dict[str, str]) -> tuple[str, str]:
    """The mountinfo and mountstats texts with each placeholder replaced by its (mangled) path."""
    mangled = {name: mangle(path) for name, path in points.items()}
    return MOUNTINFO.format(**mangled), MOUNTSTATS.format(**mangled)
