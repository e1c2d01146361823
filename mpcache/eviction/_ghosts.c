/* ARC's ghost lists in C (optional): GhostLists(), B1 and B2 (tiers 0 and 1), oldest first, with their bytes.
 *
 *   tier(key) -> int                    the list that holds key (0 or 1), -1 where neither does
 *   remove(key)                         key leaves its list (KeyError where it is no ghost)
 *   add(tier, key, nbytes, bound)       key joins list tier as its newest (leaving the list that held it); then,
 *                                       while both lists hold more than bound bytes, the oldest ghost of the one
 *                                       holding more (B2 on a tie; the other where that one is empty) leaves
 *   trim_as_arc(t1, resident, capacity) ARC's bounds, given T1's and all resident bytes: while B1 holds a ghost and
 *                                       T1 + B1 exceed capacity, B1's oldest leaves; then while a ghost is left and
 *                                       resident + B1 + B2 exceed twice capacity, B2's oldest (B1's where B2 is
 *                                       empty) leaves
 *   nbytes(tier) -> float, count(tier) -> int, keys(tier) -> list (oldest first), key in lists, len(lists)
 *
 * mpcache.eviction.ghosts.GhostListsReference is the same lists in Python; a differential test holds the two to the
 * same keys, order and bytes.  A tier that is not the int 0 or 1 is a ValueError.  Bytes are doubles, added and
 * subtracted in the reference's order, so both give the same sums.  The ``adaptive`` order adds a ghost at each
 * eviction and looks a new key up at each reservation: in C, a call each instead of an ordered dict's insertion,
 * trimming loop and two membership tests in Python; ``arc`` bounds its ghosts as ARC does in one call after each.
 * Each ghost is a slot of an array (linked oldest to newest per list); a dict maps each key to its slot.  The dict
 * changes first and the lists only once it has, so a ghost leaves whole or not at all: a key's comparison that raises
 * leaves that ghost where it was (a trim it stops keeps what it dropped before); one that calls ``add``, ``remove`` or
 * ``trim_as_arc`` on the same lists gets a RuntimeError (``tier`` and ``in`` find them whole).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if PY_VERSION_HEX >= 0x030D0000 /* the known-hash dict calls are internal from 3.13: hash again there */
#define GET_KNOWN(d, k, h) PyDict_GetItemWithError((d), (k))
#define SET_KNOWN(d, k, v, h) PyDict_SetItem((d), (k), (v))
#define DEL_KNOWN(d, k, h) PyDict_DelItem((d), (k))
#else
#define GET_KNOWN(d, k, h) _PyDict_GetItem_KnownHash((d), (k), (h))
#define SET_KNOWN(d, k, v, h) _PyDict_SetItem_KnownHash((d), (k), (v), (h))
#define DEL_KNOWN(d, k, h) _PyDict_DelItem_KnownHash((d), (k), (h))
#endif

typedef struct {
    PyObject *key;    /* owned while the slot holds a ghost */
    Py_hash_t hash;
    double nbytes;
    Py_ssize_t prev;  /* older ghost of the same list (-1: none); in the free list, unused */
    Py_ssize_t next;  /* newer ghost of the same list (-1: none); in the free list, the next free slot */
    int tier;
} Slot;

typedef struct {
    PyObject_HEAD
    PyObject *where;          /* key -> its slot (an int) */
    Slot *slots;
    Py_ssize_t allocated;
    Py_ssize_t free;          /* the first free slot, -1: none */
    Py_ssize_t oldest[2], newest[2], count[2];
    double bytes[2];
    int busy;                 /* a dict call that may run a key's comparison is under way */
} Ghosts;

/* ``arg`` as a tier (0 or 1), else -1 with ValueError set. */
static int tier_arg(PyObject *arg) {
    if (PyLong_CheckExact(arg)) {
        long tier = PyLong_AsLong(arg);
        if (tier == 0 || tier == 1)
            return (int)tier;
        PyErr_Clear();
    }
    PyErr_Format(PyExc_ValueError, "tier must be 0 or 1, not %R", arg);
    return -1;
}

/* ``arg`` as a double (an int or a float without a call: the common cases), -1.0 with an exception set. */
static double number_arg(PyObject *arg) {
    if (PyFloat_CheckExact(arg))
        return PyFloat_AS_DOUBLE(arg);
    if (PyLong_CheckExact(arg))
        return PyLong_AsDouble(arg);
    return PyFloat_AsDouble(arg);
}

/* The slot holding ``key`` (its hash put in ``hash``), -1 where none does, -2 with an exception set. */
static Py_ssize_t find(Ghosts *self, PyObject *key, Py_hash_t *hash) {
    *hash = PyObject_Hash(key);
    if (*hash == -1)
        return -2;
    self->busy++;
    PyObject *slot = GET_KNOWN(self->where, key, *hash);
    self->busy--;
    if (slot == NULL)
        return PyErr_Occurred() ? -2 : -1;
    return PyLong_AsSsize_t(slot); /* an int this type stored: no error */
}

/* Takes slot ``index`` out of the dict, then out of its list, its bytes off its list's; -1 with an exception set
 * (and nothing changed) where the dict's deletion failed. */
static int drop(Ghosts *self, Py_ssize_t index) {
    PyObject *key = self->slots[index].key;
    Py_hash_t hash = self->slots[index].hash;
    self->busy++;
    int failed = DEL_KNOWN(self->where, key, hash);  /* first: on failure nothing has changed */
    self->busy--;
    if (failed)
        return -1;
    Slot *slot = &self->slots[index];
    int tier = slot->tier;
    if (slot->prev >= 0)
        self->slots[slot->prev].next = slot->next;
    else
        self->oldest[tier] = slot->next;
    if (slot->next >= 0)
        self->slots[slot->next].prev = slot->prev;
    else
        self->newest[tier] = slot->prev;
    self->bytes[tier] -= slot->nbytes;
    self->count[tier]--;
    slot->key = NULL;
    slot->next = self->free;
    self->free = index;
    Py_DECREF(key);
    return 0;
}

/* 0, or -1 with RuntimeError set while a dict call that may run a key's comparison is under way. */
static int refuse_busy(Ghosts *self) {
    if (!self->busy)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "GhostLists changed while one of its keys was being compared");
    return -1;
}

/* A free slot's index (the array grown where none is free), -1 with MemoryError set. */
static Py_ssize_t take_free(Ghosts *self) {
    if (self->free < 0) {
        Py_ssize_t allocated = self->allocated ? self->allocated * 2 : 64;
        Slot *slots = PyMem_Realloc(self->slots, (size_t)allocated * sizeof(Slot));
        if (slots == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = self->allocated; i < allocated; i++) {
            slots[i].key = NULL;
            slots[i].next = i + 1 < allocated ? i + 1 : -1;
        }
        self->free = self->allocated;
        self->slots = slots;
        self->allocated = allocated;
    }
    Py_ssize_t index = self->free;
    self->free = self->slots[index].next;
    return index;
}

static PyObject *ghosts_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "GhostLists() takes no arguments");
        return NULL;
    }
    Ghosts *self = (Ghosts *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->where = PyDict_New();
    if (self->where == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    self->free = -1;
    for (int tier = 0; tier < 2; tier++)
        self->oldest[tier] = self->newest[tier] = -1;
    return (PyObject *)self;
}

static PyObject *ghosts_tier(Ghosts *self, PyObject *key) {
    Py_hash_t hash;
    Py_ssize_t index = find(self, key, &hash);
    if (index == -2)
        return NULL;
    return PyLong_FromLong(index < 0 ? -1 : self->slots[index].tier);
}

static PyObject *ghosts_remove(Ghosts *self, PyObject *key) {
    if (refuse_busy(self) < 0)
        return NULL;
    Py_hash_t hash;
    Py_ssize_t index = find(self, key, &hash);
    if (index == -2)
        return NULL;
    if (index == -1) {
        PyObject *wrapped = PyTuple_Pack(1, key);  /* KeyError(key), as dict raises it (a tuple key is one arg) */
        if (wrapped != NULL) {
            PyErr_SetObject(PyExc_KeyError, wrapped);
            Py_DECREF(wrapped);
        }
        return NULL;
    }
    if (drop(self, index) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *ghosts_add(Ghosts *self, PyObject *const *args, Py_ssize_t nargs) {
    if (refuse_busy(self) < 0)
        return NULL;
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "add() takes 4 arguments (tier, key, nbytes, bound), %zd given", nargs);
        return NULL;
    }
    int tier = tier_arg(args[0]);
    if (tier < 0)
        return NULL;
    PyObject *key = args[1];
    double nbytes = number_arg(args[2]);
    if (nbytes == -1.0 && PyErr_Occurred())
        return NULL;
    double bound = number_arg(args[3]);
    if (bound == -1.0 && PyErr_Occurred())
        return NULL;
    Py_hash_t hash;
    Py_ssize_t held = find(self, key, &hash);
    if (held == -2 || (held >= 0 && drop(self, held) < 0))
        return NULL;
    Py_ssize_t index = take_free(self);
    if (index < 0)
        return NULL;
    PyObject *number = PyLong_FromSsize_t(index);
    self->busy++;
    int set_failed = number == NULL || SET_KNOWN(self->where, key, number, hash) < 0;
    self->busy--;
    if (set_failed) {
        Py_XDECREF(number);
        self->slots[index].next = self->free; /* back to the free list */
        self->free = index;
        return NULL;
    }
    Py_DECREF(number);
    Slot *slot = &self->slots[index];
    slot->key = Py_NewRef(key);
    slot->hash = hash;
    slot->nbytes = nbytes;
    slot->tier = tier;
    slot->next = -1;
    slot->prev = self->newest[tier];
    if (slot->prev >= 0)
        self->slots[slot->prev].next = index;
    else
        self->oldest[tier] = index;
    self->newest[tier] = index;
    self->bytes[tier] += nbytes;
    self->count[tier]++;
    while (self->bytes[0] + self->bytes[1] > bound) {
        int larger = self->bytes[0] > self->bytes[1] ? 0 : 1;
        if (self->oldest[larger] < 0) {
            larger = 1 - larger;
            if (self->oldest[larger] < 0)
                break; /* both empty: a residue of float bytes is all that is left */
        }
        if (drop(self, self->oldest[larger]) < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *ghosts_trim_as_arc(Ghosts *self, PyObject *const *args, Py_ssize_t nargs) {
    if (refuse_busy(self) < 0)
        return NULL;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "trim_as_arc() takes 3 arguments (t1, resident, capacity), %zd given", nargs);
        return NULL;
    }
    double bounds[3];
    for (int at = 0; at < 3; at++) {
        bounds[at] = number_arg(args[at]);
        if (bounds[at] == -1.0 && PyErr_Occurred())
            return NULL;
    }
    double t1 = bounds[0], resident = bounds[1], capacity = bounds[2];
    while (self->oldest[0] >= 0 && t1 + self->bytes[0] > capacity)
        if (drop(self, self->oldest[0]) < 0)
            return NULL;
    while ((self->oldest[0] >= 0 || self->oldest[1] >= 0) && resident + self->bytes[0] + self->bytes[1] > 2 * capacity)
        if (drop(self, self->oldest[self->oldest[1] >= 0 ? 1 : 0]) < 0)
            return NULL;
    Py_RETURN_NONE;
}

static PyObject *ghosts_nbytes(Ghosts *self, PyObject *arg) {
    int tier = tier_arg(arg);
    return tier < 0 ? NULL : PyFloat_FromDouble(self->bytes[tier]);
}

static PyObject *ghosts_count(Ghosts *self, PyObject *arg) {
    int tier = tier_arg(arg);
    return tier < 0 ? NULL : PyLong_FromSsize_t(self->count[tier]);
}

static PyObject *ghosts_keys(Ghosts *self, PyObject *arg) {
    int tier = tier_arg(arg);
    if (tier < 0)
        return NULL;
    PyObject *keys = PyList_New(self->count[tier]);
    if (keys == NULL)
        return NULL;
    Py_ssize_t at = 0;
    for (Py_ssize_t index = self->oldest[tier]; index >= 0; index = self->slots[index].next)
        PyList_SET_ITEM(keys, at++, Py_NewRef(self->slots[index].key));
    return keys;
}

static int ghosts_contains(Ghosts *self, PyObject *key) {
    return PyDict_Contains(self->where, key);
}

static Py_ssize_t ghosts_length(Ghosts *self) {
    return self->count[0] + self->count[1];
}

static int ghosts_traverse(Ghosts *self, visitproc visit, void *arg) {
    Py_VISIT(self->where);
    for (Py_ssize_t index = 0; index < self->allocated; index++)
        Py_VISIT(self->slots[index].key);
    return 0;
}

/* Every ghost leaves (the lists empty, their bytes 0; the dict emptied, kept for what may still call). */
static int ghosts_clear(Ghosts *self) {
    for (int tier = 0; tier < 2; tier++) {
        self->oldest[tier] = self->newest[tier] = -1;
        self->count[tier] = 0;
        self->bytes[tier] = 0.0;
    }
    self->free = -1;
    for (Py_ssize_t index = 0; index < self->allocated; index++)
        Py_CLEAR(self->slots[index].key);
    for (Py_ssize_t index = self->allocated - 1; index >= 0; index--) {
        self->slots[index].next = self->free;
        self->free = index;
    }
    if (self->where != NULL)
        PyDict_Clear(self->where);
    return 0;
}

static void ghosts_dealloc(Ghosts *self) {
    PyObject_GC_UnTrack(self);
    ghosts_clear(self);
    Py_CLEAR(self->where);
    PyMem_Free(self->slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef ghosts_methods[] = {
    {"tier", (PyCFunction)ghosts_tier, METH_O, "tier(key) -> int: the list holding key (0 or 1), -1 where none"},
    {"remove", (PyCFunction)ghosts_remove, METH_O, "remove(key): key leaves its list (KeyError where no ghost)"},
    {"add", (PyCFunction)(void (*)(void))ghosts_add, METH_FASTCALL,
     "add(tier, key, nbytes, bound): key joins list tier, newest; the lists trimmed to bound bytes, larger first"},
    {"trim_as_arc", (PyCFunction)(void (*)(void))ghosts_trim_as_arc, METH_FASTCALL,
     "trim_as_arc(t1, resident, capacity): the ghosts bounded as ARC bounds them, given T1's and all resident bytes"},
    {"nbytes", (PyCFunction)ghosts_nbytes, METH_O, "nbytes(tier) -> float: the bytes list tier's ghosts stand for"},
    {"count", (PyCFunction)ghosts_count, METH_O, "count(tier) -> int: the ghosts list tier holds"},
    {"keys", (PyCFunction)ghosts_keys, METH_O, "keys(tier) -> list: list tier's keys, oldest first"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods ghosts_sequence = {
    .sq_length = (lenfunc)ghosts_length,
    .sq_contains = (objobjproc)ghosts_contains,
};

static PyTypeObject GhostsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpcache.eviction._ghosts.GhostLists",
    .tp_doc = "ARC's ghost lists B1 and B2: evicted keys, oldest first, with their bytes.",
    .tp_basicsize = sizeof(Ghosts),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = ghosts_new,
    .tp_dealloc = (destructor)ghosts_dealloc,
    .tp_traverse = (traverseproc)ghosts_traverse,
    .tp_clear = (inquiry)ghosts_clear,
    .tp_methods = ghosts_methods,
    .tp_as_sequence = &ghosts_sequence,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_ghosts", "ARC's ghost lists in C (optional).", -1, NULL,
};

PyMODINIT_FUNC PyInit__ghosts(void) {
    if (PyType_Ready(&GhostsType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "GhostLists", (PyObject *)&GhostsType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
