/* Fenwick-tree steps over an int64 array, for the miss-ratio curves' reuse stack (optional).
 *
 *   add(tree, slot, delta)        tree[slot] += delta, and up the tree (slots 1..len(tree)-1)
 *   prefix(tree, slot) -> int     the sum over slots 1..slot (slot 0: 0)
 *
 * ``tree`` is a one-dimensional buffer of int64 (``array('q')``; ``add`` needs it writable).  A slot
 * outside the tree is an IndexError, a sum that leaves int64 an OverflowError, with the tree unchanged.
 * mpcache.telemetry.mrc.fenwick has the same two functions in Python; a differential test holds the two
 * to the same trees and answers.  Each access of the curves takes one ``add`` to drop its key's old slot,
 * one to set the new one, and one ``prefix`` per stratum: in C, a call instead of a Python loop each.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The int64 elements of ``obj``, or -1 with an exception set. */
static int tree_view(PyObject *obj, Py_buffer *view, int writable) {
    if (PyObject_GetBuffer(obj, view, (writable ? PyBUF_WRITABLE : 0) | PyBUF_FORMAT | PyBUF_ND) == 0) {
        if (view->ndim == 1 && view->itemsize == 8 && view->format != NULL && strcmp(view->format, "q") == 0)
            return 0;
        PyBuffer_Release(view);
    }
    PyErr_Clear(); /* not a buffer, or a read-only one: the same error as Python's */
    PyErr_SetString(PyExc_TypeError, "the tree must be a writable one-dimensional buffer of int64 (array('q'))");
    return -1;
}

static int slot_arg(PyObject *value, Py_ssize_t low, Py_ssize_t high, Py_ssize_t *out) {
    Py_ssize_t slot = PyLong_AsSsize_t(value);
    if (slot == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear(); /* far outside the tree: an IndexError, as in Python */
        PyErr_SetString(PyExc_IndexError, "slot is outside the tree");
        return -1;
    }
    if (slot < low || slot > high) {
        PyErr_Format(PyExc_IndexError, "slot %zd is outside the tree (%zd..%zd)", slot, low, high);
        return -1;
    }
    *out = slot;
    return 0;
}

static PyObject *fenwick_add(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "add() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_buffer view;
    if (tree_view(args[0], &view, 1) < 0)
        return NULL;
    int64_t *tree = (int64_t *)view.buf;
    Py_ssize_t size = view.shape[0] - 1, slot;
    long long delta;
    int overflow = 0;
    if (slot_arg(args[1], 1, size, &slot) < 0)
        goto fail;
    delta = PyLong_AsLongLongAndOverflow(args[2], &overflow);
    if (overflow || (delta == -1 && PyErr_Occurred())) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_OverflowError, "delta does not fit int64");
        goto fail;
    }
    for (Py_ssize_t at = slot; at <= size; at += at & -at) { /* check every step first: all or nothing */
        int64_t sum;
        if (__builtin_add_overflow(tree[at], (int64_t)delta, &sum)) {
            PyErr_SetString(PyExc_OverflowError, "a tree sum leaves int64");
            goto fail;
        }
    }
    for (Py_ssize_t at = slot; at <= size; at += at & -at)
        tree[at] += (int64_t)delta;
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&view);
    return NULL;
}

static PyObject *fenwick_prefix(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "prefix() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_buffer view;
    if (tree_view(args[0], &view, 0) < 0)
        return NULL;
    const int64_t *tree = (const int64_t *)view.buf;
    Py_ssize_t slot;
    int64_t total = 0;
    if (slot_arg(args[1], 0, view.shape[0] - 1, &slot) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    for (; slot > 0; slot -= slot & -slot) {
        if (__builtin_add_overflow(total, tree[slot], &total)) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_OverflowError, "the prefix sum leaves int64");
            return NULL;
        }
    }
    PyBuffer_Release(&view);
    return PyLong_FromLongLong((long long)total);
}

static PyMethodDef methods[] = {
    {"add", (PyCFunction)(void (*)(void))fenwick_add, METH_FASTCALL, "add(tree, slot, delta)"},
    {"prefix", (PyCFunction)(void (*)(void))fenwick_prefix, METH_FASTCALL, "prefix(tree, slot) -> int"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_fenwick", "Fenwick-tree steps over an int64 array (optional).", -1, methods,
};

PyMODINIT_FUNC PyInit__fenwick(void) { return PyModule_Create(&module_def); }
