/* The fields of a lookup's MRC_LOOKUP_SAMPLED event when every chunk is a head chunk, and its tail's marks
 * (optional).
 *
 *   head_fields(model, salt, hashes, ranks, l1_hits, found, exact_chunks, head_slots, gap_shift, entry_of)
 *       -> tuple | None
 *
 * The common lookup of a prefix cache asks for at most ``exact_chunks`` chunks: its event is then fixed
 * fields only, built here in one call instead of a few dozen Python steps.  ``hashes`` is the lookup's
 * list of keys (``ranks`` per chunk), ``entry_of((model, salt, hash))`` L1's entry lookup (an entry with a
 * true ``ready`` is held).  The answer is ``(model, salt, ranks, found, l1_hits, exact | gap bits, 0, 0, 0,
 * head_0 .. head_{head_slots-1})`` with ``l1_hits`` capped at ``found``, the first rank's key of each chunk
 * and zeros after them, and bit ``gap_shift + i`` set for each chunk i past the first missing one that L1
 * holds.  None when it is not that case (another type, a negative count, chunks past the head): the caller
 * then builds the event in Python.  mpcache.cache.mrc.headfields has the same function in Python; a
 * differential test holds the two to the same answers and the same exceptions (those of ``entry_of``).
 *
 *   tail_marks(hashes, start, ranks, from_start, mark_bits, end_marks, end_mark_bits, words, fmix) -> tuple | None
 *
 * The marks of a lookup with chunks past the head (below).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

static int count_arg(PyObject *value, Py_ssize_t *out) {
    if (!PyLong_CheckExact(value))
        return -1;
    Py_ssize_t v = PyLong_AsSsize_t(value);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    *out = v;
    return v < 0 ? -1 : 0;
}

static PyObject *head_fields(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_Format(PyExc_TypeError, "head_fields() takes 10 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *model = args[0], *salt = args[1], *hashes = args[2], *entry_of = args[9];
    Py_ssize_t ranks, l1_hits, found, exact_chunks, head_slots, gap_shift;
    if (!PyList_CheckExact(hashes) || count_arg(args[3], &ranks) || ranks < 1 || count_arg(args[4], &l1_hits) ||
        count_arg(args[5], &found) || count_arg(args[6], &exact_chunks) || count_arg(args[7], &head_slots) ||
        count_arg(args[8], &gap_shift) || exact_chunks > head_slots || gap_shift + head_slots > 62)
        Py_RETURN_NONE;
    Py_ssize_t count = PyList_GET_SIZE(hashes), exact = count / ranks;
    if (exact > exact_chunks)
        exact = exact_chunks;
    if (exact * ranks != count) /* chunks past the head: sampled keys to find, in Python */
        Py_RETURN_NONE;
    if (l1_hits > found)
        l1_hits = found;
    PyObject *fields = PyTuple_New(9 + head_slots);
    if (fields == NULL)
        return NULL;
    long long gap_mask = 0;
    for (Py_ssize_t chunk = 0; chunk < exact; chunk++) {
        PyObject *hash = PyList_GET_ITEM(hashes, chunk * ranks); /* borrowed: the list is not changed here */
        Py_INCREF(hash);
        PyTuple_SET_ITEM(fields, 9 + chunk, hash);
    }
    for (Py_ssize_t chunk = found / ranks + 1; chunk < exact; chunk++) { /* held past the gap? */
        PyObject *key = PyTuple_Pack(3, model, salt, PyTuple_GET_ITEM(fields, 9 + chunk));
        if (key == NULL)
            goto fail;
        PyObject *entry = PyObject_CallOneArg(entry_of, key);
        Py_DECREF(key);
        if (entry == NULL)
            goto fail;
        int held = 0;
        if (entry != Py_None) {
            PyObject *ready = PyObject_GetAttrString(entry, "ready");
            held = ready == NULL ? -1 : PyObject_IsTrue(ready);
            Py_XDECREF(ready);
        }
        Py_DECREF(entry);
        if (held < 0)
            goto fail;
        if (held)
            gap_mask |= 1LL << (gap_shift + chunk);
    }
    PyObject *numbers[7] = {PyLong_FromSsize_t(ranks), PyLong_FromSsize_t(found), PyLong_FromSsize_t(l1_hits),
                            PyLong_FromLongLong((long long)exact | gap_mask), NULL, NULL, NULL};
    for (int i = 0; i < 4; i++) {
        if (numbers[i] == NULL) {
            for (int j = 0; j < 4; j++)
                Py_XDECREF(numbers[j]);
            goto fail;
        }
    }
    Py_INCREF(model);
    Py_INCREF(salt);
    PyTuple_SET_ITEM(fields, 0, model);
    PyTuple_SET_ITEM(fields, 1, salt);
    for (int i = 0; i < 4; i++)
        PyTuple_SET_ITEM(fields, 2 + i, numbers[i]);
    PyObject *zero = PyLong_FromLong(0); /* a small int: immortal in effect, counted all the same */
    if (zero == NULL)
        goto fail;
    for (Py_ssize_t i = 6; i < 9; i++) {
        Py_INCREF(zero);
        PyTuple_SET_ITEM(fields, i, zero);
    }
    for (Py_ssize_t i = 9 + exact; i < 9 + head_slots; i++) {
        Py_INCREF(zero);
        PyTuple_SET_ITEM(fields, i, zero);
    }
    Py_DECREF(zero);
    return fields;
fail:
    Py_DECREF(fields); /* unset items are NULL: the tuple's dealloc skips them */
    return NULL;
}

static int put_mark(PyObject *key, unsigned long long first, unsigned long long second, Py_ssize_t bits,
                    Py_ssize_t at, unsigned long long *packed) {
    PyObject *number = PyNumber_Index(key); /* as operator.index reads it */
    if (number == NULL)
        return -1;
    unsigned long long value = PyLong_AsUnsignedLongLongMask(number);
    Py_DECREF(number);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    value = (value ^ (value >> 33)) * first; /* MurmurHash3's fmix64 */
    value = (value ^ (value >> 33)) * second;
    unsigned long long mark = (value ^ (value >> 33)) >> (64 - bits);
    packed[at / 64] |= mark << (at % 64);
    if (at % 64 + bits > 64) /* a mark across two words */
        packed[at / 64 + 1] |= mark >> (64 - at % 64);
    return 0;
}

/* tail_marks(hashes, start, ranks, from_start, mark_bits, end_marks, end_mark_bits, words, fmix) -> tuple | None
 *
 * The mark words of the tail of ``hashes`` that begins at ``start`` (mpcache.contract.tail_marks.pack, whose
 * layout the arguments give): chunk c's mark is the top bits of fmix64 (with the two multipliers ``fmix``) of its
 * first rank's key's low 64 bits, ``mark_bits``
 * of them for each chunk of ``from_start`` the tail has, in that order, then ``end_mark_bits`` for each of its
 * last ``end_marks`` chunks.  None when the arguments are not that case (``hashes`` not a list, a negative start,
 * no rank, a layout that does not fit ``words`` words): the caller then packs them in Python, which raises where
 * it should.  A key that is not an integer raises TypeError, as operator.index does. */
static PyObject *tail_marks(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "tail_marks() takes 9 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *hashes = args[0], *from_start = args[3];
    Py_ssize_t start, ranks, mark_bits, end_marks, end_mark_bits, words;
    PyObject *fmix = args[8];
    if (!PyList_CheckExact(hashes) || !PyTuple_CheckExact(from_start) || !PyTuple_CheckExact(fmix) ||
        PyTuple_GET_SIZE(fmix) != 2 || !PyLong_CheckExact(PyTuple_GET_ITEM(fmix, 0)) ||
        !PyLong_CheckExact(PyTuple_GET_ITEM(fmix, 1)) ||
        count_arg(args[1], &start) || count_arg(args[2], &ranks) || ranks < 1 || count_arg(args[4], &mark_bits) ||
        count_arg(args[5], &end_marks) || count_arg(args[6], &end_mark_bits) || count_arg(args[7], &words) ||
        words < 1 || words > 4 || mark_bits < 1 || mark_bits > 16 || end_mark_bits < 1 || end_mark_bits > 16 ||
        end_marks > 64 * words || PyTuple_GET_SIZE(from_start) > 64 * words ||
        PyTuple_GET_SIZE(from_start) * mark_bits + end_marks * end_mark_bits > 64 * words)
        Py_RETURN_NONE;
    unsigned long long first = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(fmix, 0));
    unsigned long long second = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(fmix, 1));
    if (PyErr_Occurred())
        return NULL;
    unsigned long long packed[4] = {0, 0, 0, 0};
    Py_ssize_t count = PyList_GET_SIZE(hashes), past = count > start ? count - start : 0;
    Py_ssize_t chunks = past / ranks + (past % ranks != 0); /* no overflow, whatever ranks is */
    Py_ssize_t marked = PyTuple_GET_SIZE(from_start);
    for (Py_ssize_t index = 0; index < marked; index++) {
        Py_ssize_t chunk;
        if (count_arg(PyTuple_GET_ITEM(from_start, index), &chunk))
            Py_RETURN_NONE;
        if (chunk >= chunks)
            break;
        if (put_mark(PyList_GET_ITEM(hashes, start + chunk * ranks), first, second, mark_bits, index * mark_bits,
                     packed))
            return NULL;
    }
    for (Py_ssize_t chunk = chunks > end_marks ? chunks - end_marks : 0; chunk < chunks; chunk++) {
        Py_ssize_t at = marked * mark_bits + (chunk - chunks + end_marks) * end_mark_bits;
        if (put_mark(PyList_GET_ITEM(hashes, start + chunk * ranks), first, second, end_mark_bits, at, packed))
            return NULL;
    }
    PyObject *out = PyTuple_New(words);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t word = 0; word < words; word++) {
        PyObject *value = PyLong_FromUnsignedLongLong(packed[word]);
        if (value == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, word, value);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"head_fields", (PyCFunction)(void (*)(void))head_fields, METH_FASTCALL,
     "head_fields(model, salt, hashes, ranks, l1_hits, found, exact_chunks, head_slots, gap_shift, entry_of)"},
    {"tail_marks", (PyCFunction)(void (*)(void))tail_marks, METH_FASTCALL,
     "tail_marks(hashes, start, ranks, from_start, mark_bits, end_marks, end_mark_bits, words, fmix)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_headfields", "A lookup's MRC event fields: when every chunk is a head chunk, and the "
    "marks of its tail (optional).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__headfields(void) { return PyModule_Create(&module_def); }
