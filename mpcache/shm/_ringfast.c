/* The ring producer in C: the compiled form of mpcache.shm.ring's writer (optional).
 *
 *   WriterCore     — the producer's state and its append protocol.  It holds the
 *                    segment's buffer (an export, so the mapping cannot go away
 *                    under it), the cursor (head, limit, seq: members that the
 *                    Python subclass RingWriter reads and writes), and
 *                    append(record, ncells, args): room check, seq, one
 *                    record.pack_into (record.pack across the wrap), commit.
 *
 *   OneCellEmitter — emit(a, b, c) for one event type: stamps a template cell
 *                    with the sequence number, a timestamp and three int64
 *                    values, copies it into the ring and commits it.  The
 *                    commonest publish in one C call.
 *
 *   FieldsEmitter  — emit(fields, session_id[, timestamp_ns]) for one event type: its fixed
 *                    fields (ints, bools, floats, interned names) in a head
 *                    cell and at most three FIELDS cells, and a session id of at
 *                    most one TEXT cell.  Whatever is not that regular case (a
 *                    name not interned yet, a value that does not fit, a longer
 *                    session id, ...) goes to the Python emitter it was given,
 *                    before anything was written, so the two cannot disagree.
 *
 * This file knows no offsets of its own: the template cell, the cell size and
 * every offset come from mpcache.shm.layout through ring.py, which owns the byte
 * layout and the protocol's description.  Nothing here blocks; a full ring or a
 * value that does not pack drops the record and counts it in the shared dropped
 * word — the same bytes and counters as ring.py's pure-Python writer, which a
 * differential test checks.  The commit is a release store of head (and the
 * tail is read with acquire), so the protocol is sound on any CPU here.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the ring layout is little-endian; this build falls back to the pure-Python writer"
#endif

#define MAX_CELL 256
#define MAX_STACK_ARGS 64

static PyObject *struct_error;   /* struct.error */
static PyObject *str_pack_into;  /* "pack_into" */
static PyObject *str_pack;       /* "pack" */

/* ---------------------------------------------------------------- WriterCore */

typedef struct {
    PyObject_HEAD
    unsigned long long head;  /* cells committed (mirrors the shared head word) */
    unsigned long long limit; /* head may grow up to here: last tail seen + capacity */
    unsigned long long seq;   /* sequence number the next record carries */
    PyObject *buffer;         /* what append hands to pack_into */
    Py_buffer view;
    unsigned char *cells;
    uint64_t *head_word, *tail_word, *dropped_word;
    unsigned long long capacity, mask;
    Py_ssize_t cells_offset, cell_size;
    unsigned char empty_cell[MAX_CELL]; /* written over a head cell whose pack failed */
} WriterCore;

static int check_word(Py_buffer *view, Py_ssize_t offset, const char *what) {
    if (offset < 0 || offset % 8 || offset + 8 > view->len) {
        PyErr_Format(PyExc_ValueError, "%s word offset %zd is outside the segment or misaligned", what, offset);
        return -1;
    }
    return 0;
}

static int core_init(WriterCore *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"buffer", "cells_offset", "capacity", "cell_size", "head_offset", "tail_offset",
                             "dropped_offset", "empty_cell", NULL};
    PyObject *buffer;
    Py_ssize_t cells_offset, cell_size, head_off, tail_off, dropped_off;
    unsigned long long capacity;
    Py_buffer empty;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OnKnnnny*", kwlist, &buffer, &cells_offset, &capacity,
                                     &cell_size, &head_off, &tail_off, &dropped_off, &empty))
        return -1;
    int result = -1;
    if (self->buffer != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "WriterCore is already initialised");
        goto done;
    }
    if (capacity == 0 || (capacity & (capacity - 1)) || cell_size <= 0 || cell_size > MAX_CELL ||
        empty.len != cell_size) {
        PyErr_SetString(PyExc_ValueError, "capacity must be a power of two, cell_size 1..256 = len(empty_cell)");
        goto done;
    }
    if (PyObject_GetBuffer(buffer, &self->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (check_word(&self->view, head_off, "head") || check_word(&self->view, tail_off, "tail") ||
        check_word(&self->view, dropped_off, "dropped") || ((uintptr_t)self->view.buf % 8)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "the segment's buffer is not 8-byte aligned");
        PyBuffer_Release(&self->view);
        goto done;
    }
    if (cells_offset < 0 || cells_offset > self->view.len ||
        (unsigned long long)(self->view.len - cells_offset) / (unsigned long long)cell_size < capacity) {
        PyErr_Format(PyExc_ValueError, "a %zd-byte segment cannot hold %llu cells from offset %zd",
                     self->view.len, capacity, cells_offset);
        PyBuffer_Release(&self->view);
        goto done;
    }
    unsigned char *base = self->view.buf;
    self->cells = base + cells_offset;
    self->head_word = (uint64_t *)(base + head_off);
    self->tail_word = (uint64_t *)(base + tail_off);
    self->dropped_word = (uint64_t *)(base + dropped_off);
    self->capacity = capacity;
    self->mask = capacity - 1;
    self->cells_offset = cells_offset;
    self->cell_size = cell_size;
    memcpy(self->empty_cell, empty.buf, cell_size);
    Py_INCREF(buffer);
    self->buffer = buffer;
    result = 0;
done:
    PyBuffer_Release(&empty);
    return result;
}

static void core_dealloc(WriterCore *self) {
    if (self->buffer != NULL) {
        PyBuffer_Release(&self->view);
        Py_CLEAR(self->buffer);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int core_ready(WriterCore *self) {
    if (self->buffer == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "WriterCore.__init__ was not called");
        return 0;
    }
    return 1;
}

/* One more record in the shared dropped word (the producer is its only writer). */
static void bump_dropped(WriterCore *self) {
    __atomic_store_n(self->dropped_word, __atomic_load_n(self->dropped_word, __ATOMIC_RELAXED) + 1,
                     __ATOMIC_RELAXED);
}

static void count_drop(WriterCore *self) {
    self->seq++; /* a dropped record spends its sequence number: the gap is visible to the reader */
    bump_dropped(self);
}

/* Whether ncells more fit; re-reads the consumer's tail, and counts a drop when they do not. */
static int has_room(WriterCore *self, unsigned long long ncells) {
    if (self->head + ncells <= self->limit)
        return 1;
    self->limit = __atomic_load_n(self->tail_word, __ATOMIC_ACQUIRE) + self->capacity;
    if (self->head + ncells <= self->limit)
        return 1;
    count_drop(self);
    return 0;
}

static void commit(WriterCore *self, unsigned long long ncells) {
    self->head += ncells;
    __atomic_store_n(self->head_word, self->head, __ATOMIC_RELEASE); /* the commit */
}

/* A pack that failed with one of these is a bad value: the record is dropped, not raised. */
static int is_bad_value_error(void) {
    return PyErr_ExceptionMatches(struct_error) || PyErr_ExceptionMatches(PyExc_TypeError) ||
           PyErr_ExceptionMatches(PyExc_ValueError) || PyErr_ExceptionMatches(PyExc_OverflowError);
}

static PyObject *drop_bad_value(WriterCore *self, unsigned char *head_cell) {
    PyErr_Clear();
    memcpy(head_cell, self->empty_cell, self->cell_size); /* pack may have begun the head cell */
    bump_dropped(self);
    Py_RETURN_FALSE;
}

/* record.<method>(*prefix, *values) with the argument vector on the stack when it is short. */
static PyObject *call_with(PyObject *method, PyObject *record, PyObject **prefix, Py_ssize_t nprefix,
                           PyObject *values) {
    PyObject *seq = PySequence_Fast(values, "append() args must be a list or tuple");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), total = 1 + nprefix + n;
    PyObject *stack[MAX_STACK_ARGS];
    PyObject **vector = total <= MAX_STACK_ARGS ? stack : PyMem_Malloc(total * sizeof(PyObject *));
    PyObject *result = NULL;
    if (vector == NULL) {
        PyErr_NoMemory();
    } else {
        vector[0] = record;
        if (nprefix)
            memcpy(vector + 1, prefix, nprefix * sizeof(PyObject *));
        memcpy(vector + 1 + nprefix, PySequence_Fast_ITEMS(seq), n * sizeof(PyObject *));
        result = PyObject_VectorcallMethod(method, vector, total | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (vector != stack)
            PyMem_Free(vector);
    }
    Py_DECREF(seq);
    return result;
}

PyDoc_STRVAR(core_append_doc,
"append(record, ncells, args) -> bool\n\n"
"Publish one record of ncells cells packed by the struct.Struct record from args.\n"
"False, and counted, when the ring is full or the values do not pack.");

static PyObject *core_append(WriterCore *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "append() takes exactly 3 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!core_ready(self))
        return NULL;
    Py_ssize_t ncells = PyLong_AsSsize_t(args[1]);
    if (ncells == -1 && PyErr_Occurred())
        return NULL;
    if (ncells < 1) {
        PyErr_Format(PyExc_ValueError, "a record has at least one cell, got %zd", ncells);
        return NULL;
    }
    if (!has_room(self, (unsigned long long)ncells))
        Py_RETURN_FALSE;
    self->seq++;
    unsigned long long pos = self->head & self->mask;
    unsigned char *head_cell = self->cells + pos * self->cell_size;
    if (pos + ncells <= self->capacity) {
        PyObject *offset = PyLong_FromSsize_t(self->cells_offset + (Py_ssize_t)pos * self->cell_size);
        if (offset == NULL)
            return NULL;
        PyObject *prefix[2] = {self->buffer, offset};
        PyObject *done = call_with(str_pack_into, args[0], prefix, 2, args[2]);
        Py_DECREF(offset);
        if (done == NULL)
            return is_bad_value_error() ? drop_bad_value(self, head_cell) : NULL;
        Py_DECREF(done);
    } else { /* the record wraps: pack it whole, then copy it in two pieces */
        PyObject *data = call_with(str_pack, args[0], NULL, 0, args[2]);
        if (data == NULL)
            return is_bad_value_error() ? drop_bad_value(self, head_cell) : NULL;
        if (!PyBytes_Check(data) || PyBytes_GET_SIZE(data) != ncells * self->cell_size) {
            Py_DECREF(data); /* a record shape that disagrees with ncells: drop it rather than write it */
            return drop_bad_value(self, head_cell);
        }
        Py_ssize_t first = (Py_ssize_t)(self->capacity - pos) * self->cell_size;
        memcpy(head_cell, PyBytes_AS_STRING(data), first);
        memcpy(self->cells, PyBytes_AS_STRING(data) + first, PyBytes_GET_SIZE(data) - first);
        Py_DECREF(data);
    }
    commit(self, (unsigned long long)ncells);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(core_has_room_doc,
"_has_room(ncells) -> bool\n\n"
"Whether ncells more cells fit (re-reading the consumer's tail); counts a drop when not.");

static PyObject *core_has_room(WriterCore *self, PyObject *arg) {
    if (!core_ready(self))
        return NULL;
    unsigned long long ncells = PyLong_AsUnsignedLongLong(arg);
    if (ncells == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(has_room(self, ncells));
}

PyDoc_STRVAR(core_count_drop_doc,
"count_drop()\n\nCount a record the caller could not even encode (its sequence number is spent).");

static PyObject *core_count_drop(WriterCore *self, PyObject *unused) {
    if (!core_ready(self))
        return NULL;
    count_drop(self);
    Py_RETURN_NONE;
}

static PyMethodDef core_methods[] = {
    {"append", (PyCFunction)(void (*)(void))core_append, METH_FASTCALL, core_append_doc},
    {"_has_room", (PyCFunction)core_has_room, METH_O, core_has_room_doc},
    {"count_drop", (PyCFunction)core_count_drop, METH_NOARGS, core_count_drop_doc},
    {NULL}
};

static PyMemberDef core_members[] = {
    {"_head", T_ULONGLONG, offsetof(WriterCore, head), 0, "cells committed so far"},
    {"_limit", T_ULONGLONG, offsetof(WriterCore, limit), 0, "last tail seen plus capacity"},
    {"seq", T_ULONGLONG, offsetof(WriterCore, seq), 0, "sequence number of the next record"},
    {"_buf", T_OBJECT, offsetof(WriterCore, buffer), READONLY, "the segment's buffer"},
    {"_capacity", T_ULONGLONG, offsetof(WriterCore, capacity), READONLY, "ring capacity in cells"},
    {"_mask", T_ULONGLONG, offsetof(WriterCore, mask), READONLY, "capacity - 1"},
    {"_cells_off", T_PYSSIZET, offsetof(WriterCore, cells_offset), READONLY, "byte offset of cell 0"},
    {NULL}
};

static PyTypeObject WriterCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpcache.shm._ringfast.WriterCore",
    .tp_doc = "The ring producer's state and append protocol (compiled); RingWriter subclasses it.",
    .tp_basicsize = sizeof(WriterCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)core_init,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_methods = core_methods,
    .tp_members = core_members,
};

/* ------------------------------------------------------------ OneCellEmitter */

/* Copy a template cell (any bytes-like object of exactly one cell) into ``target``. */
static int copy_cell(PyObject *source, unsigned char *target, Py_ssize_t cell, const char *what) {
    Py_buffer view;
    if (PyObject_GetBuffer(source, &view, PyBUF_SIMPLE) < 0)
        return -1;
    int ok = view.len == cell;
    if (ok)
        memcpy(target, view.buf, cell);
    else
        PyErr_Format(PyExc_ValueError, "the %s template is %zd bytes, a cell is %zd", what, view.len, cell);
    PyBuffer_Release(&view);
    return ok ? 0 : -1;
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    WriterCore *core; /* strong reference */
    PyObject *clock;  /* None: CLOCK_REALTIME, what time.time_ns() reads; else called for ns */
    Py_ssize_t seq_off, ts_off, value_off[3];
    unsigned char template[MAX_CELL];
} OneCellEmitter;

static int read_int64(PyObject *value, int64_t *out) {
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

/* The record's timestamp: CLOCK_REALTIME (what time.time_ns() reads) or the injected clock's ns. */
static int timestamp_ns(PyObject *clock, int64_t *out) {
    if (clock == Py_None) {
        struct timespec now;
        clock_gettime(CLOCK_REALTIME, &now);
        *out = (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
        return 0;
    }
    PyObject *value = PyObject_CallNoArgs(clock);
    if (value == NULL)
        return -1;
    int failed = read_int64(value, out);
    Py_DECREF(value);
    return failed;
}

/* emit(a, b, c) -> bool.  A value that is not an int64 drops the record (never raises). */
static PyObject *emitter_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    OneCellEmitter *self = (OneCellEmitter *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 3 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_Format(PyExc_TypeError, "emit() takes exactly 3 positional arguments (%zd given)", nargs);
        return NULL;
    }
    WriterCore *core = self->core;
    if (core == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "OneCellEmitter.__init__ was not called");
        return NULL;
    }
    if (!has_room(core, 1))
        Py_RETURN_FALSE;
    unsigned char *target = core->cells + (core->head & core->mask) * core->cell_size;
    uint32_t seq32 = (uint32_t)core->seq++;
    int64_t stamp, values[3];
    if (timestamp_ns(self->clock, &stamp) || read_int64(args[0], &values[0]) || read_int64(args[1], &values[1]) ||
        read_int64(args[2], &values[2]))
        return is_bad_value_error() ? drop_bad_value(core, target) : NULL;
    unsigned char cell[MAX_CELL];
    memcpy(cell, self->template, core->cell_size);
    memcpy(cell + self->seq_off, &seq32, 4);
    memcpy(cell + self->ts_off, &stamp, 8);
    for (int i = 0; i < 3; i++)
        memcpy(cell + self->value_off[i], &values[i], 8);
    memcpy(target, cell, core->cell_size);
    commit(core, 1);
    Py_RETURN_TRUE;
}

static PyObject *emitter_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    OneCellEmitter *self = (OneCellEmitter *)type->tp_alloc(type, 0); /* zero-filled */
    if (self != NULL)
        self->vectorcall = emitter_call;
    return (PyObject *)self;
}

static int emitter_init(OneCellEmitter *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"core", "template", "seq_offset", "timestamp_offset", "value_offsets", "clock", NULL};
    PyObject *core, *template, *clock = Py_None;
    Py_ssize_t seq_off, ts_off, v0, v1, v2;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!Onn(nnn)|O", kwlist, &WriterCoreType, &core, &template,
                                     &seq_off, &ts_off, &v0, &v1, &v2, &clock))
        return -1;
    WriterCore *writer = (WriterCore *)core;
    Py_ssize_t cell = writer->cell_size;
    Py_ssize_t fields[][2] = {{seq_off, 4}, {ts_off, 8}, {v0, 8}, {v1, 8}, {v2, 8}};
    if (self->core != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "OneCellEmitter is already initialised");
        return -1;
    }
    if (!core_ready(writer) || copy_cell(template, self->template, cell, "one-cell"))
        return -1;
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        if (fields[i][0] < 0 || fields[i][0] + fields[i][1] > cell) {
            PyErr_Format(PyExc_ValueError, "field offset %zd does not fit a %zd-byte cell", fields[i][0], cell);
            return -1;
        }
    }
    if (clock != Py_None && !PyCallable_Check(clock)) {
        PyErr_SetString(PyExc_TypeError, "clock must be None or a callable returning ns");
        return -1;
    }
    self->seq_off = seq_off;
    self->ts_off = ts_off;
    self->value_off[0] = v0;
    self->value_off[1] = v1;
    self->value_off[2] = v2;
    Py_INCREF(clock);
    self->clock = clock;
    Py_INCREF(core);
    self->core = writer;
    return 0;
}

/* The emitters take part in garbage collection: a Publisher holds them, and an injected clock
 * or the fallback emitter can hold the Publisher, a cycle only the collector can break. */
static int emitter_traverse(OneCellEmitter *self, visitproc visit, void *arg) {
    Py_VISIT(self->core);
    Py_VISIT(self->clock);
    return 0;
}

static int emitter_clear(OneCellEmitter *self) {
    Py_CLEAR(self->core);
    Py_CLEAR(self->clock);
    return 0;
}

static void emitter_dealloc(OneCellEmitter *self) {
    PyObject_GC_UnTrack(self);
    emitter_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject OneCellEmitterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpcache.shm._ringfast.OneCellEmitter",
    .tp_doc = "emit(a, b, c) -> bool: publish one templated cell into a ring (compiled hot path).",
    .tp_basicsize = sizeof(OneCellEmitter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_new = emitter_new,
    .tp_init = (initproc)emitter_init,
    .tp_dealloc = (destructor)emitter_dealloc,
    .tp_traverse = (traverseproc)emitter_traverse,
    .tp_clear = (inquiry)emitter_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(OneCellEmitter, vectorcall),
};

/* ------------------------------------------------------------- FieldsEmitter */

#define MAX_FIELD_CELLS 3                         /* FIELDS cells after the head cell */
#define MAX_FIELDS (6 + 7 * MAX_FIELD_CELLS)      /* six in the head cell, seven in each FIELDS cell */
#define MAX_RECORD_CELLS (2 + MAX_FIELD_CELLS)    /* head, FIELDS cells, one text cell */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    WriterCore *core;   /* strong references from here on */
    PyObject *ids;      /* dict: name -> interned id */
    PyObject *clock;    /* None: CLOCK_REALTIME; else called for ns */
    PyObject *fallback; /* the Python emitter: fallback(fields, session_id[, timestamp_ns]) -> bool */
    Py_ssize_t n_fields, seq_off, ts_off, text_length_off, text_data_off, text_capacity;
    Py_ssize_t field_cell[MAX_FIELDS], field_off[MAX_FIELDS];
    char field_kind[MAX_FIELDS]; /* 'q' int64 (int, bool), 'Q' uint64 (a hash), 'd' float64, 'n' interned name */
    Py_ssize_t field_cells;     /* the type's FIELDS cells, 0..MAX_FIELD_CELLS */
    unsigned char head_plain[MAX_CELL], head_with_text[MAX_CELL], fields[MAX_FIELD_CELLS][MAX_CELL], text[MAX_CELL];
} FieldsEmitter;

/* The slot bits of one field, or -1 (no exception set) when it is not the regular case. */
static int field_bits(FieldsEmitter *self, char kind, PyObject *value, int64_t *out) {
    if (kind == 'n') {
        if (!PyUnicode_CheckExact(value)) /* a subclass's __hash__ or __eq__ could change the fields under us */
            return -1;
        value = PyDict_GetItemWithError(self->ids, value); /* borrowed */
        if (value == NULL) {
            PyErr_Clear(); /* not interned yet, or unhashable: the Python emitter decides */
            return -1;
        }
    }
    if (kind == 'd') {
        double d;
        if (PyFloat_CheckExact(value)) {
            d = PyFloat_AS_DOUBLE(value);
        } else if (PyLong_CheckExact(value)) {
            d = PyLong_AsDouble(value);
            if (d == -1.0 && PyErr_Occurred()) {
                PyErr_Clear();
                return -1;
            }
        } else {
            return -1;
        }
        memcpy(out, &d, 8);
        return 0;
    }
    if (!PyLong_Check(value)) /* int and bool; anything else is the Python emitter's to judge */
        return -1;
    if (kind == 'Q') {
        unsigned long long u = PyLong_AsUnsignedLongLong(value);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return -1;
        }
        memcpy(out, &u, 8);
        return 0;
    }
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    *out = v;
    return 0;
}

static PyObject *fields_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    FieldsEmitter *self = (FieldsEmitter *)callable;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 2 || nargs > 3 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_Format(PyExc_TypeError, "emit() takes 2 or 3 positional arguments (%zd given)", nargs);
        return NULL;
    }
    if (self->core == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "FieldsEmitter.__init__ was not called");
        return NULL;
    }
    PyObject *fields = args[0], *session = args[1];
    PyObject *const *items;
    Py_ssize_t n;
    if (PyTuple_CheckExact(fields)) {
        items = &PyTuple_GET_ITEM(fields, 0);
        n = PyTuple_GET_SIZE(fields);
    } else if (PyList_CheckExact(fields)) {
        items = PySequence_Fast_ITEMS(fields);
        n = PyList_GET_SIZE(fields);
    } else {
        return PyObject_Vectorcall(self->fallback, args, nargs, NULL);
    }
    int64_t bits[MAX_FIELDS];
    const char *text = NULL;
    Py_ssize_t text_len = 0;
    int regular = n == self->n_fields && PyUnicode_CheckExact(session);
    for (Py_ssize_t i = 0; regular && i < n; i++)
        regular = field_bits(self, self->field_kind[i], items[i], &bits[i]) == 0;
    if (regular && PyUnicode_GET_LENGTH(session) > 0) {
        text = PyUnicode_AsUTF8AndSize(session, &text_len); /* fails on lone surrogates: "replace" is Python's */
        if (text == NULL)
            PyErr_Clear();
        regular = text != NULL && text_len <= self->text_capacity;
    }
    PyObject *given = nargs == 3 ? args[2] : Py_None; /* the timestamp, when the caller has one */
    int64_t stamp;
    if (regular && given != Py_None)
        regular = PyLong_CheckExact(given) && read_int64(given, &stamp) == 0;
    if (!regular) {
        PyErr_Clear();
        return PyObject_Vectorcall(self->fallback, args, nargs, NULL);
    }
    if (given == Py_None && timestamp_ns(self->clock, &stamp)) { /* before the room check, as in Python */
        if (!is_bad_value_error())
            return NULL;
        PyErr_Clear();
        return PyObject_Vectorcall(self->fallback, args, nargs, NULL);
    }
    WriterCore *core = self->core;
    Py_ssize_t cell = core->cell_size, ncells = 1 + self->field_cells + (text_len > 0);
    if (!has_room(core, (unsigned long long)ncells))
        Py_RETURN_FALSE;
    unsigned char record[MAX_RECORD_CELLS * MAX_CELL];
    memcpy(record, text_len > 0 ? self->head_with_text : self->head_plain, cell);
    for (Py_ssize_t c = 0; c < self->field_cells; c++)
        memcpy(record + cell * (1 + c), self->fields[c], cell);
    if (text_len > 0) {
        unsigned char *text_cell = record + cell * (1 + self->field_cells);
        memcpy(text_cell, self->text, cell);
        text_cell[self->text_length_off] = (unsigned char)text_len;
        memcpy(text_cell + self->text_data_off, text, text_len);
    }
    uint32_t seq32 = (uint32_t)core->seq++;
    for (Py_ssize_t c = 0; c < ncells; c++)
        memcpy(record + c * cell + self->seq_off, &seq32, 4);
    memcpy(record + self->ts_off, &stamp, 8);
    for (Py_ssize_t i = 0; i < n; i++)
        memcpy(record + self->field_cell[i] * cell + self->field_off[i], &bits[i], 8);
    for (Py_ssize_t c = 0; c < ncells; c++) /* cell by cell: the record may wrap */
        memcpy(core->cells + ((core->head + c) & core->mask) * cell, record + c * cell, cell);
    commit(core, (unsigned long long)ncells);
    Py_RETURN_TRUE;
}

static int fields_init(FieldsEmitter *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"core", "head_templates", "fields_templates", "text_template", "field_slots",
                             "seq_offset", "timestamp_offset", "text_length_offset", "text_data_offset",
                             "ids", "clock", "fallback", NULL};
    PyObject *core, *head_plain, *head_with_text, *fields_templates, *text_template, *slots, *ids, *clock,
        *fallback;
    Py_ssize_t seq_off, ts_off, length_off, data_off;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!(OO)O!OO!nnnnO!OO", kwlist, &WriterCoreType, &core,
                                     &head_plain, &head_with_text, &PyTuple_Type, &fields_templates, &text_template,
                                     &PyTuple_Type, &slots, &seq_off, &ts_off, &length_off, &data_off,
                                     &PyDict_Type, &ids, &clock, &fallback))
        return -1;
    WriterCore *writer = (WriterCore *)core;
    if (self->core != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "FieldsEmitter is already initialised");
        return -1;
    }
    if (!core_ready(writer))
        return -1;
    Py_ssize_t cell = writer->cell_size, n = PyTuple_GET_SIZE(slots), field_cells = PyTuple_GET_SIZE(fields_templates);
    if (n > MAX_FIELDS || field_cells > MAX_FIELD_CELLS || (clock != Py_None && !PyCallable_Check(clock)) ||
        !PyCallable_Check(fallback)) {
        PyErr_Format(PyExc_ValueError, "at most %d field slots in %d FIELDS cells, a callable (or None) clock, a "
                     "callable fallback", MAX_FIELDS, MAX_FIELD_CELLS);
        return -1;
    }
    if (seq_off < 0 || seq_off + 4 > cell || ts_off < 0 || ts_off + 8 > cell || length_off < 0 ||
        length_off >= cell || data_off < 0 || data_off > cell) {
        PyErr_SetString(PyExc_ValueError, "an offset does not fit a cell");
        return -1;
    }
    self->field_cells = field_cells;
    if (copy_cell(head_plain, self->head_plain, cell, "head") ||
        copy_cell(head_with_text, self->head_with_text, cell, "head (with text)") ||
        copy_cell(text_template, self->text, cell, "text"))
        return -1;
    for (Py_ssize_t c = 0; c < field_cells; c++)
        if (copy_cell(PyTuple_GET_ITEM(fields_templates, c), self->fields[c], cell, "fields"))
            return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t which, offset;
        int kind;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(slots, i), "nnC", &which, &offset, &kind))
            return -1;
        if (which < 0 || which > self->field_cells || offset < 0 || offset + 8 > cell ||
            (kind != 'q' && kind != 'Q' && kind != 'd' && kind != 'n')) {
            PyErr_Format(PyExc_ValueError, "field slot %zd: (cell %zd, offset %zd, kind %c) is not valid", i, which,
                         offset, kind);
            return -1;
        }
        self->field_cell[i] = which;
        self->field_off[i] = offset;
        self->field_kind[i] = (char)kind;
    }
    self->n_fields = n;
    self->seq_off = seq_off;
    self->ts_off = ts_off;
    self->text_length_off = length_off;
    self->text_data_off = data_off;
    self->text_capacity = cell - data_off < 255 ? cell - data_off : 255;
    Py_INCREF(ids);
    self->ids = ids;
    Py_INCREF(clock);
    self->clock = clock;
    Py_INCREF(fallback);
    self->fallback = fallback;
    Py_INCREF(core);
    self->core = writer;
    return 0;
}

static PyObject *fields_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    FieldsEmitter *self = (FieldsEmitter *)type->tp_alloc(type, 0); /* zero-filled */
    if (self != NULL)
        self->vectorcall = fields_call;
    return (PyObject *)self;
}

static int fields_traverse(FieldsEmitter *self, visitproc visit, void *arg) {
    Py_VISIT(self->core);
    Py_VISIT(self->ids);
    Py_VISIT(self->clock);
    Py_VISIT(self->fallback);
    return 0;
}

static int fields_clear(FieldsEmitter *self) {
    Py_CLEAR(self->core);
    Py_CLEAR(self->ids);
    Py_CLEAR(self->clock);
    Py_CLEAR(self->fallback);
    return 0;
}

static void fields_dealloc(FieldsEmitter *self) {
    PyObject_GC_UnTrack(self);
    fields_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject FieldsEmitterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpcache.shm._ringfast.FieldsEmitter",
    .tp_doc = "emit(fields, session_id[, timestamp_ns]) -> bool: publish one fixed-field record (compiled hot path).",
    .tp_basicsize = sizeof(FieldsEmitter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_new = fields_new,
    .tp_init = (initproc)fields_init,
    .tp_dealloc = (destructor)fields_dealloc,
    .tp_traverse = (traverseproc)fields_traverse,
    .tp_clear = (inquiry)fields_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(FieldsEmitter, vectorcall),
};

/* -------------------------------------------------------------------- module */

static struct PyModuleDef ringfast_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mpcache.shm._ringfast",
    .m_doc = "The ring producer in C (optional; mpcache.shm.ring has the same writer in pure Python).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__ringfast(void) {
    PyObject *struct_module = PyImport_ImportModule("struct");
    if (struct_module == NULL)
        return NULL;
    struct_error = PyObject_GetAttrString(struct_module, "error");
    Py_DECREF(struct_module);
    str_pack_into = PyUnicode_InternFromString("pack_into");
    str_pack = PyUnicode_InternFromString("pack");
    if (struct_error == NULL || str_pack_into == NULL || str_pack == NULL)
        return NULL;
    if (PyType_Ready(&WriterCoreType) < 0 || PyType_Ready(&OneCellEmitterType) < 0 ||
        PyType_Ready(&FieldsEmitterType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&ringfast_module);
    if (module == NULL)
        return NULL;
    Py_INCREF(&WriterCoreType);
    Py_INCREF(&OneCellEmitterType);
    Py_INCREF(&FieldsEmitterType);
    if (PyModule_AddObject(module, "WriterCore", (PyObject *)&WriterCoreType) < 0 ||
        PyModule_AddObject(module, "OneCellEmitter", (PyObject *)&OneCellEmitterType) < 0 ||
        PyModule_AddObject(module, "FieldsEmitter", (PyObject *)&FieldsEmitterType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
