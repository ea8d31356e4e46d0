# The sandbox's first process (rollouts/sandbox.py runs it as ``python -I -S -c <this file's text>``): standard library
# only, nothing imported from the package. It reads one JSON line of settings and then the code from stdin (so that no
# host path shows in /proc/1/cmdline), isolates itself, sets the limits and execs the code as process 2.
#
# Isolated: new mount, UTS, IPC, PID and network namespaces (and a user namespace when not root). The root is an empty
# tmpfs with read-only binds of the Python installation and the system libraries; /work and /tmp are one tmpfs of
# disk_mb / disk_files that exists only in this mount namespace (nothing reaches the host's disk, and it vanishes with
# the namespace); /proc is the sandbox's own. Root drops to the slot's uid (one uid per concurrent sandbox, so that
# RLIMIT_NPROC counts this sandbox alone); a user namespace counts its own processes (per-namespace ucounts, Linux
# 5.14+). Each process gets memory_mb / processes of address space: their product bounds the sandbox. A seccomp filter
# refuses namespaces, mounts, ptrace, keys, bpf, perf, io_uring, module and kexec calls (EPERM; clone3: ENOSYS, so
# libc falls back to clone, whose namespace flags are checked). Process 1 ends the namespace (and every process in it)
# at the wall-clock limit even if the trainer that started it is gone.
import ctypes
import json
import os
import resource
import select
import signal
import struct
import sys

cfg: dict = {}  # the settings (main reads them from stdin)
libc = ctypes.CDLL(None, use_errno=True)
PROGRAM = "main.py"  # the code's file in /work
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
NEWCGROUP = 0x2000000
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 22, 38
MACHINE = os.uname().machine
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(MACHINE)
MB = 1 << 20

# seccomp: the refused calls' numbers on x86_64 (asm/unistd_64.h) and aarch64 (asm-generic/unistd.h)
DENIED = {
    "unshare": (272, 97),
    "setns": (308, 268),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "reboot": (169, 142),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "acct": (163, 89),
    "sethostname": (170, 161),
    "setdomainname": (171, 162),
    "iopl": (172, None),
    "ioperm": (173, None),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
}
ARCH = {"x86_64": (0, 0xC000003E, 56), "aarch64": (1, 0xC00000B7, 220)}  # column in DENIED, audit arch, clone
CLONE3 = 435
NS_FLAGS = NEWNS | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWCGROUP


def fail(what):
    err = ctypes.get_errno()
    sys.stdout.write(f"sandbox isolation failed: {what}: {os.strerror(err)}\n")
    sys.stdout.flush()
    os._exit(97)


def mount(src, dst, fstype, flags, data=None):
    def enc(s):
        return s.encode() if s is not None else None

    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        fail(f"mount {src} on {dst}")


def bind_ro(path, root):
    target = root + path
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    mount(path, target, None, BIND | REC)
    st = os.statvfs(path)
    locked = st.f_flag & (NOSUID | NODEV | NOEXEC)
    atime = (
        (1024 if st.f_flag & 1024 else 0) | (2048 if st.f_flag & 2048 else 0) | ((1 << 21) if st.f_flag & 4096 else 0)
    )
    mount(None, target, None, REMOUNT | BIND | RDONLY | locked | atime)


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


def limits():
    per_process = max(cfg["memory_mb"] // cfg["processes"], 16) * MB  # their product bounds the sandbox
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))  # SIGXCPU first: said as such
    for res, value in (
        (resource.RLIMIT_AS, per_process),
        (resource.RLIMIT_FSIZE, cfg["file_mb"] * MB),
        (resource.RLIMIT_NOFILE, cfg["open_files"]),
        (resource.RLIMIT_NPROC, cfg["processes"]),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_MEMLOCK, 0),
        (resource.RLIMIT_MSGQUEUE, 0),
    ):
        resource.setrlimit(res, (value, value))


def seccomp_filter():
    """A classic BPF program: wrong architecture or an x32 call: killed; a listed call: EPERM; clone3: ENOSYS;
    clone with a namespace flag: EPERM; the rest allowed."""
    if MACHINE not in ARCH:
        return False
    column, arch, clone = ARCH[MACHINE]
    numbers = [nrs[column] for nrs in DENIED.values() if nrs[column] is not None]
    LD, JEQ, JSET, JGE, RET = 0x20, 0x15, 0x45, 0x35, 0x06
    KILL, ALLOW, ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, KILL), (LD, 0, 0, 0)]
    if MACHINE == "x86_64":
        prog += [(JGE, 0, 1, 0x40000000), (RET, 0, 0, KILL)]
    for nr in numbers:
        prog += [(JEQ, 0, 1, nr), (RET, 0, 0, ERRNO | 1)]  # EPERM
    prog += [(JEQ, 0, 1, CLONE3), (RET, 0, 0, ERRNO | 38)]  # ENOSYS
    prog += [(JEQ, 0, 3, clone), (LD, 0, 0, 16), (JSET, 0, 1, NS_FLAGS), (RET, 0, 0, ERRNO | 1), (RET, 0, 0, ALLOW)]
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))
    fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(buf))
    fbuf = ctypes.create_string_buffer(fprog, len(fprog))
    ulong = ctypes.c_ulong
    return libc.prctl(PR_SET_SECCOMP, ulong(2), ulong(ctypes.addressof(fbuf)), ulong(0), ulong(0)) == 0  # MODE_FILTER


def run_code():
    """Process 2: limits, the filter, then the code (its stdin empty, its output the pipe to the trainer)."""
    limits()
    if cfg["seccomp"] and not seccomp_filter():
        sys.stdout.write(f"sandbox isolation failed: seccomp: {os.strerror(ctypes.get_errno())}\n")
        sys.stdout.flush()
        os._exit(97)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.execve(cfg["python"], [cfg["python"], "-I", "-S", PROGRAM], cfg["env"])


def exit_status(status: int) -> int:
    return os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def drop_to_slot_uid():
    """Root becomes the slot's uid: RLIMIT_NPROC binds it, and it counts this call alone."""
    os.setgroups([])
    os.setgid(cfg["drop_to"])
    os.setuid(cfg["drop_to"])


def unisolated():
    """Limits only, in the host folder the trainer made (rollouts/sandbox.py says when)."""
    os.chdir(cfg["work"])
    if os.getuid() == 0:
        drop_to_slot_uid()
    run_code()


def enter_namespaces() -> int:
    """Returns in process 1 of the new namespaces, with the read end of a pipe whose EOF says the bootstrap (this
    process, which stays outside to wait for process 1) is gone."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the trainer gone: this process and the namespace with it
    if os.getppid() != cfg["parent"]:
        os._exit(97)
    root_user = os.getuid() == 0
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(NEWNS | NEWUTS | NEWIPC | NEWPID | NEWNET | (0 if root_user else NEWUSER)) != 0:
        fail("unshare")
    if not root_user:
        write("/proc/self/setgroups", "deny")
        write("/proc/self/uid_map", f"0 {uid} 1")
        write("/proc/self/gid_map", f"0 {gid} 1")
    alive_r, alive_w = os.pipe()
    child = os.fork()  # process 1 of the new PID namespace
    if child:  # SIGTERM (the trainer's timeout): process 1 killed; it is reaped once all of its namespace is gone
        signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGKILL))
        _, status = os.waitpid(child, 0)
        os._exit(exit_status(status))
    os.close(alive_w)
    return alive_r


def build_root(code: bytes, root_user: bool) -> None:
    """The sandbox's file system, then pivot_root into it: an empty tmpfs, the read-only binds, a few devices,
    /work and /tmp (one tmpfs: one size and inode budget, bound twice, its own mount point detached), /proc."""
    mount(None, "/", None, REC | PRIVATE)
    root = cfg["root"]
    mount("tmpfs", root, "tmpfs", NOSUID | NODEV, "size=1m,mode=755")
    for path in cfg["ro_binds"]:
        if os.path.islink(path):
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(os.readlink(path), root + path)
        elif os.path.exists(path):
            bind_ro(path, root)
    os.makedirs(root + "/dev", exist_ok=True)
    for dev in ("null", "zero", "urandom", "random"):
        open(root + "/dev/" + dev, "a").close()
        mount("/dev/" + dev, root + "/dev/" + dev, None, BIND)
    rw, owner = root + "/.rw", (cfg["drop_to"] if root_user else 0)
    os.makedirs(rw)
    mount("tmpfs", rw, "tmpfs", NOSUID | NODEV, f"size={cfg['disk_mb']}m,nr_inodes={cfg['disk_files']},mode=755")
    for name, mode in (("work", 0o700), ("tmp", 0o1777)):
        os.makedirs(rw + "/" + name)
        os.chmod(rw + "/" + name, mode)
        os.chown(rw + "/" + name, owner, owner)
        os.makedirs(root + "/" + name)
        mount(rw + "/" + name, root + "/" + name, None, BIND)
    program = os.path.join(rw, "work", PROGRAM)
    with open(program, "wb") as f:
        f.write(code)
    os.chown(program, owner, owner)
    if libc.umount2(rw.encode(), 2) != 0:  # MNT_DETACH
        fail(f"umount {rw}")
    os.rmdir(rw)
    os.makedirs(root + "/proc")
    mount("proc", root + "/proc", "proc", NOSUID | NODEV | NOEXEC)
    os.chdir(root)
    os.makedirs(".old")
    if PIVOT_ROOT is None or libc.syscall(PIVOT_ROOT, b".", b".old") != 0:
        fail("pivot_root")
    os.chdir("/")
    if libc.umount2(b"/.old", 2) != 0:
        fail("umount the old root")
    os.rmdir("/.old")
    mount(None, "/", None, REMOUNT | RDONLY | NOSUID | NODEV)
    libc.sethostname(b"sandbox", 7)


def be_process_one(alive_r: int, root_user: bool) -> None:
    """Drop privileges, run the code as process 2 and reap until it ends; then end the namespace with its status."""
    if root_user:
        drop_to_slot_uid()
    # killing the bootstrap ends the namespace and all in it (set after setuid, which clears it; the pipe's EOF says
    # whether the bootstrap died before)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if select.select([alive_r], [], [], 0)[0]:
        os._exit(97)
    os.close(alive_r)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    os.chdir("/work")
    signal.signal(signal.SIGALRM, lambda *_: os._exit(124))  # the wall-clock limit, held here too
    signal.alarm(int(cfg["wall_s"]) + 5)
    code_pid = os.fork()  # the code runs as process 2: limits kill it as they would anywhere (init ignores SIGXCPU)
    if code_pid == 0:
        signal.alarm(0)
        run_code()
    while True:
        pid, status = os.wait()
        if pid == code_pid:
            os._exit(exit_status(status))


def main() -> None:
    header, _, code = sys.stdin.buffer.read().partition(b"\n")
    cfg.update(json.loads(header))
    if not cfg["isolate"]:
        unisolated()
    root_user = os.getuid() == 0
    alive_r = enter_namespaces()
    build_root(code, root_user)
    be_process_one(alive_r, root_user)


if __name__ == "__main__":
    main()
