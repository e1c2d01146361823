/* A fault on a shared-memory mapping that another process shrank, survived (optional).
 *
 *   guard(address, length, fd) -> slot      faults(slot) -> int      unguard(slot)
 *
 * A peer of the same uid can ftruncate a POSIX shared-memory object that this process maps; a load or store
 * past the new end is then a SIGBUS, which kills the process whichever thread or library (numpy, libzmq, an
 * L2 client) made the access.  ``guard`` registers one mapping (``length`` bytes at ``address``, of the object
 * open as ``fd``, which must stay open while guarded; ``unguard`` before it is unmapped) and, the first time,
 * installs a process-wide SIGBUS handler.  On a fault inside a guarded mapping the handler gives the object its size back (ftruncate, which
 * is async-signal-safe), counts the fault and returns: the access is retried and now lands on zero-filled
 * pages.  What was in the cut-off part is lost; the caller polls ``faults`` and treats the mapping's contents
 * as damaged.  Any other SIGBUS (another address, a restore that fails, one sent with kill) goes to the
 * disposition that was in place before, re-raised.  No Python code runs in the handler.
 */

#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <unistd.h>

#define MAX_GUARDS 8

struct guard {
    _Atomic uintptr_t start; /* 0: a free slot; stored last when a slot is taken, so the rest is complete */
    uintptr_t end;
    int fd;
    off_t size;
    atomic_long faults;
};

static struct guard guards[MAX_GUARDS];
static struct sigaction previous;
static int installed;

static void on_sigbus(int signum, siginfo_t *info, void *context) {
    uintptr_t address = (uintptr_t)info->si_addr;
    if (info->si_code > 0) { /* raised by a fault, not sent */
        for (int i = 0; i < MAX_GUARDS; i++) {
            struct guard *g = &guards[i];
            uintptr_t start = atomic_load(&g->start);
            if (start != 0 && address >= start && address < g->end) {
                if (ftruncate(g->fd, g->size) == 0) {
                    atomic_fetch_add(&g->faults, 1);
                    return; /* the access is retried on the restored object */
                }
                break;
            }
        }
    }
    sigaction(SIGBUS, &previous, NULL);
    raise(SIGBUS); /* blocked until this handler returns, then delivered to the previous disposition */
}

static PyObject *guard(PyObject *module, PyObject *args) {
    unsigned long long address;
    Py_ssize_t length;
    int fd;
    if (!PyArg_ParseTuple(args, "Kni:guard", &address, &length, &fd))
        return NULL;
    if (address == 0 || length <= 0 || fd < 0) {
        PyErr_SetString(PyExc_ValueError, "guard: expected a mapping's address, its length and an open descriptor");
        return NULL;
    }
    int slot = 0;
    while (slot < MAX_GUARDS && atomic_load(&guards[slot].start) != 0)
        slot++;
    if (slot == MAX_GUARDS) {
        PyErr_Format(PyExc_RuntimeError, "guard: at most %d mappings are guarded", MAX_GUARDS);
        return NULL;
    }
    if (!installed) {
        struct sigaction action;
        memset(&action, 0, sizeof action);
        action.sa_sigaction = on_sigbus;
        action.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&action.sa_mask);
        if (sigaction(SIGBUS, &action, &previous) != 0)
            return PyErr_SetFromErrno(PyExc_OSError);
        installed = 1;
    }
    guards[slot].end = (uintptr_t)address + (uintptr_t)length;
    guards[slot].fd = fd;
    guards[slot].size = (off_t)length;
    atomic_store(&guards[slot].faults, 0);
    atomic_store(&guards[slot].start, (uintptr_t)address);
    return PyLong_FromLong(slot);
}

static long slot_arg(PyObject *arg, const char *name) {
    long slot = PyLong_AsLong(arg);
    if (slot == -1 && PyErr_Occurred())
        return -1;
    if (slot < 0 || slot >= MAX_GUARDS || atomic_load(&guards[slot].start) == 0) {
        PyErr_Format(PyExc_ValueError, "%s: no guarded mapping %ld", name, slot);
        return -1;
    }
    return slot;
}

static PyObject *faults(PyObject *module, PyObject *arg) {
    long slot = slot_arg(arg, "faults");
    return slot < 0 ? NULL : PyLong_FromLong(atomic_load(&guards[slot].faults));
}

static PyObject *unguard(PyObject *module, PyObject *arg) {
    long slot = slot_arg(arg, "unguard");
    if (slot < 0)
        return NULL;
    atomic_store(&guards[slot].start, 0);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"guard", guard, METH_VARARGS, "guard(address, length, fd) -> slot: survive a SIGBUS in this mapping."},
    {"faults", faults, METH_O, "faults(slot) -> int: faults survived in that mapping so far."},
    {"unguard", unguard, METH_O, "unguard(slot): that mapping is about to go; its slot is free again."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_busguard", NULL, -1, methods};

PyMODINIT_FUNC PyInit__busguard(void) { return PyModule_Create(&module); }
