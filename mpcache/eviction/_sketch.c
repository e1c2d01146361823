/* The adaptive order's frequency sketch in C (optional): FrequencySketch(window, code=hash, *, item=None).
 *
 *   add(key) -> int         count ``key`` once: ENDED (1) where this count ended a window (every counter halved),
 *                           plus SAMPLED (2) where the key is sampled at ``sample_bits``
 *   sample_bits             -1 (at first): no key sampled; 0: every key; n (to 64): a key whose mixed word's top n
 *                           bits are 0 (another value: ValueError, or TypeError for what is not an int)
 *   estimate(key) -> int    the smaller of its two counters
 *   resize(window)          halve once ``window`` counts are held; rows too narrow for it become wider, empty ones
 *   window                  the counts a window holds (read-only)
 *   _rows                   both rows' counters, as two bytes objects (a copy, for tests)
 *
 * mpcache.eviction.frequency.FrequencySketchReference is the same sketch in Python; a differential test holds the
 * two to the same counters, windows and answers.  A sketch is set up when it is made (``__init__`` again changes
 * nothing), and a code that returns what is not an int is a TypeError.  A key's code (``code(key)``; with ``item``, a
 * tuple key's item at that index, read without a call, and a key that is no tuple that long a TypeError; else its hash)
 * is taken modulo 2^64 and multiplied by MIX modulo 2^64: the first row's counter is that word's low bits, the second's
 * its bits from 32 up (rows are at most MAX_WIDTH counters wide, so no index reads past the word).  ``add`` is called
 * for every chunk a lookup finds and every chunk a store reserves: in C, a call instead of about twenty Python
 * operations.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include "structmember.h"

#define SATURATED 255                        /* a counter is one byte */
#define MIN_WIDTH ((Py_ssize_t)1 << 10)      /* counters per row at the least */
#define MAX_WIDTH ((int64_t)1 << 32)         /* counters per row at the most: indexes read the word's 64 bits only */
#define COUNTERS_PER_COUNT 4                 /* a row's counters per count its window holds */
#define MIX 0x9E3779B97F4A7C15ULL            /* spreads a small integer's code over both rows' indexes */

static PyObject *builtin_hash; /* ``code`` is this by default: then PyObject_Hash, without a call */

typedef struct {
    PyObject_HEAD
    PyObject *code;      /* NULL: the key's hash, or its item */
    Py_ssize_t item;     /* the index of a tuple key's item that is its code; -1: none */
    uint8_t *rows;       /* the first row, then the second: 2 * width counters */
    Py_ssize_t width;    /* counters per row, a power of two */
    Py_ssize_t window;   /* counts between two halvings */
    Py_ssize_t counted;  /* counts held since the last halving (halved with the counters) */
    int sample_bits;     /* which keys ``add`` says are sampled (see the top of the file) */
} Sketch;

#define ENDED 1
#define SAMPLED 2

/* Whether a key of mixed word ``word`` is sampled at ``bits``. */
static int sampled(uint64_t word, int bits) {
    if (bits < 0)
        return 0;
    if (bits == 0)
        return 1;
    return bits >= 64 ? word == 0 : (word >> (64 - bits)) == 0;
}

/* The width a window of ``window`` counts needs: the power of two at or above COUNTERS_PER_COUNT * window,
 * within MIN_WIDTH..MAX_WIDTH (compared as width / COUNTERS_PER_COUNT: the product may not fit). */
static Py_ssize_t width_for(Py_ssize_t window) {
    int64_t width = MIN_WIDTH;
    while (width < MAX_WIDTH && width / COUNTERS_PER_COUNT < window)
        width <<= 1;
    return (Py_ssize_t)width;
}

/* Sets the window (at least 1; past Py_ssize_t clipped: a window that long never ends) and, where the rows are too
 * narrow for it, replaces them by empty, wider ones; on an error (the window not an int, no memory for the rows)
 * nothing changes. */
static int set_window(Sketch *self, PyObject *window_arg) {
    Py_ssize_t window = PyNumber_AsSsize_t(window_arg, NULL);
    if (window == -1 && PyErr_Occurred())
        return -1;
    if (window < 1)
        window = 1;
    Py_ssize_t width = width_for(window);
    if (width > self->width) {
        uint8_t *rows = PyMem_Calloc((size_t)width, 2);
        if (rows == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        PyMem_Free(self->rows);
        self->rows = rows;
        self->width = width;
    }
    self->window = window;
    return 0;
}

/* The mixed 64-bit word of ``key``'s code, in ``word``; -1 with an exception set. */
static int mixed_word(Sketch *self, PyObject *key, uint64_t *word) {
    if (self->item >= 0) {
        if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) <= self->item) {
            PyErr_Format(PyExc_TypeError, "a key must be a tuple of more than %zd items", self->item);
            return -1;
        }
        PyObject *code = PyTuple_GET_ITEM(key, self->item); /* borrowed: the caller holds the key */
        if (!PyLong_Check(code)) {
            PyErr_Format(PyExc_TypeError, "a key's code must be an int, not %.100s", Py_TYPE(code)->tp_name);
            return -1;
        }
        unsigned long long low = PyLong_AsUnsignedLongLongMask(code); /* an int's value: it runs no code */
        if (low == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        *word = (uint64_t)low * MIX;
        return 0;
    }
    if (self->code == NULL) {
        Py_hash_t hash = PyObject_Hash(key);
        if (hash == -1 && PyErr_Occurred())
            return -1;
        *word = (uint64_t)hash * MIX;
        return 0;
    }
    PyObject *callable = Py_NewRef(self->code); /* held across the call, whatever it does */
    PyObject *code = PyObject_CallOneArg(callable, key);
    Py_DECREF(callable);
    if (code == NULL)
        return -1;
    if (!PyLong_Check(code)) {
        PyErr_Format(PyExc_TypeError, "a key's code must be an int, not %.100s", Py_TYPE(code)->tp_name);
        Py_DECREF(code);
        return -1;
    }
    unsigned long long low = PyLong_AsUnsignedLongLongMask(code); /* modulo 2^64, two's complement for < 0 */
    Py_DECREF(code);
    if (low == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *word = (uint64_t)low * MIX;
    return 0;
}

/* Everything is set up here, not in __init__: a sketch has its rows from the moment it exists, and none can be
 * set up again. */
static PyObject *sketch_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"window", "code", "item", NULL};
    PyObject *window = NULL, *code = NULL, *item = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|O$O:FrequencySketch", keywords, &window, &code, &item))
        return NULL;
    if (code != NULL && !PyCallable_Check(code)) {
        PyErr_SetString(PyExc_TypeError, "code must be callable");
        return NULL;
    }
    Py_ssize_t index = -1;
    if (item != Py_None) {
        if (code != NULL && code != builtin_hash) {
            PyErr_SetString(PyExc_TypeError, "give code or item, not both");
            return NULL;
        }
        if (!PyLong_Check(item)) {
            PyErr_Format(PyExc_TypeError, "item must be an int, not %.100s", Py_TYPE(item)->tp_name);
            return NULL;
        }
        index = PyLong_AsSsize_t(item);
        if (index == -1 && PyErr_Occurred())
            return NULL;
        if (index < 0) {
            PyErr_SetString(PyExc_ValueError, "item must be 0 or more");
            return NULL;
        }
        code = NULL;
    }
    Sketch *self = (Sketch *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (code != NULL && code != builtin_hash)
        self->code = Py_NewRef(code);
    self->item = index;
    self->sample_bits = -1;
    if (set_window(self, window) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static PyObject *sketch_add(Sketch *self, PyObject *key) {
    uint64_t word;
    if (mixed_word(self, key, &word) < 0)
        return NULL;
    uint64_t mask = (uint64_t)self->width - 1;
    uint8_t *first = self->rows, *second = self->rows + self->width, *counter;
    counter = first + (word & mask);
    if (*counter < SATURATED)
        *counter += 1;
    counter = second + ((word >> 32) & mask);
    if (*counter < SATURATED)
        *counter += 1;
    long flags = sampled(word, self->sample_bits) ? SAMPLED : 0;
    if (++self->counted < self->window)
        return PyLong_FromLong(flags);
    for (Py_ssize_t at = 0, end = 2 * self->width; at < end; at++)
        self->rows[at] >>= 1;
    self->counted >>= 1; /* the counts halved: the next window ends sooner by what they still hold */
    return PyLong_FromLong(flags | ENDED);
}

static PyObject *sketch_estimate(Sketch *self, PyObject *key) {
    uint64_t word;
    if (mixed_word(self, key, &word) < 0)
        return NULL;
    uint64_t mask = (uint64_t)self->width - 1;
    uint8_t first = self->rows[word & mask], second = self->rows[self->width + ((word >> 32) & mask)];
    return PyLong_FromLong(first < second ? first : second);
}

static PyObject *sketch_resize(Sketch *self, PyObject *window) {
    if (set_window(self, window) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *sketch_rows(Sketch *self, void *closure) {
    const char *rows = (const char *)self->rows;
    return Py_BuildValue("(y#y#)", rows, self->width, rows + self->width, self->width);
}

static int sketch_traverse(Sketch *self, visitproc visit, void *arg) {
    Py_VISIT(self->code);
    return 0;
}

static int sketch_clear(Sketch *self) {
    Py_CLEAR(self->code);
    return 0;
}

static void sketch_dealloc(Sketch *self) {
    PyObject_GC_UnTrack(self);
    sketch_clear(self);
    PyMem_Free(self->rows);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef sketch_methods[] = {
    {"add", (PyCFunction)sketch_add, METH_O, "add(key) -> int: counts key once; ENDED | SAMPLED flags"},
    {"estimate", (PyCFunction)sketch_estimate, METH_O, "estimate(key) -> int: how often key was counted lately"},
    {"resize", (PyCFunction)sketch_resize, METH_O, "resize(window): halve once window counts are held"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef sketch_members[] = {
    {"window", T_PYSSIZET, offsetof(Sketch, window), READONLY, "counts between two halvings"},
    {NULL, 0, 0, 0, NULL},
};

static PyObject *sketch_get_sample_bits(Sketch *self, void *closure) {
    return PyLong_FromLong(self->sample_bits);
}

/* An int from -1 to 64, else ValueError (TypeError for what is not an int), the sketch unchanged. */
static int sketch_set_sample_bits(Sketch *self, PyObject *value, void *closure) {
    if (value == NULL || !PyLong_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "sample_bits must be an int");
        return -1;
    }
    int overflow = 0;
    long bits = PyLong_AsLongAndOverflow(value, &overflow);
    if (bits == -1 && PyErr_Occurred())
        return -1;
    if (overflow || bits < -1 || bits > 64) {
        PyErr_SetString(PyExc_ValueError, "sample_bits must be from -1 to 64");
        return -1;
    }
    self->sample_bits = (int)bits;
    return 0;
}

static PyGetSetDef sketch_getset[] = {
    {"sample_bits", (getter)sketch_get_sample_bits, (setter)sketch_set_sample_bits,
     "which keys add says are sampled: -1 none, 0 every key, n those whose mixed word's top n bits are 0", NULL},
    {"_rows", (getter)sketch_rows, NULL, "both rows' counters (a copy)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject SketchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpcache.eviction._sketch.FrequencySketch",
    .tp_doc = "A count-min sketch of two rows of byte counters, halved once a window of counts is held.",
    .tp_basicsize = sizeof(Sketch),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = sketch_new,
    .tp_dealloc = (destructor)sketch_dealloc,
    .tp_traverse = (traverseproc)sketch_traverse,
    .tp_clear = (inquiry)sketch_clear,
    .tp_methods = sketch_methods,
    .tp_members = sketch_members,
    .tp_getset = sketch_getset,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_sketch", "The adaptive order's frequency sketch in C (optional).", -1, NULL,
};

PyMODINIT_FUNC PyInit__sketch(void) {
    PyObject *builtins = PyImport_ImportModule("builtins");
    if (builtins == NULL)
        return NULL;
    builtin_hash = PyObject_GetAttrString(builtins, "hash");
    Py_DECREF(builtins);
    if (builtin_hash == NULL || PyType_Ready(&SketchType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    PyObject *max_width = PyLong_FromLongLong(MAX_WIDTH), *mix = PyLong_FromUnsignedLongLong(MIX);
    int failed = max_width == NULL || mix == NULL
        || PyModule_AddObjectRef(module, "FrequencySketch", (PyObject *)&SketchType) < 0
        || PyModule_AddIntConstant(module, "SATURATED", SATURATED) < 0
        || PyModule_AddIntConstant(module, "MIN_WIDTH", MIN_WIDTH) < 0
        || PyModule_AddObjectRef(module, "MAX_WIDTH", max_width) < 0
        || PyModule_AddIntConstant(module, "COUNTERS_PER_COUNT", COUNTERS_PER_COUNT) < 0
        || PyModule_AddIntConstant(module, "ENDED", ENDED) < 0
        || PyModule_AddIntConstant(module, "SAMPLED", SAMPLED) < 0
        || PyModule_AddObjectRef(module, "MIX", mix) < 0;
    Py_XDECREF(max_width);
    Py_XDECREF(mix);
    if (failed) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
