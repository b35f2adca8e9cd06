/* The chained block keys of a prompt (prefix_index.chain_keys), computed in C.
 *
 * Owns one function, chain_keys(prompt, block, max_blocks), that returns exactly
 * the keys of the pure-Python fallback: key_k = hash((key_{k-1}, hash(ids[kB:(k+1)B])))
 * with key_{-1} = 0, CPython's tuple hash (xxHash-based, the same since 3.8) and
 * int hash reproduced here, each id hashed by its type's tp_hash as tuple hashing
 * does. It must never give other keys than the fallback (KV-event filing and the
 * other API servers use those): tests/unit/test_prefix_routing.py compares them.
 * Nothing here holds state or runs Python code for int ids.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#if PY_VERSION_HEX < 0x030B0000
#include <longintrepr.h> /* PyLongObject's digits (Python.h includes them from 3.11) */
#endif

#if SIZEOF_PY_UHASH_T > 4
#define XXPRIME_1 ((Py_uhash_t)11400714785074694791ULL)
#define XXPRIME_2 ((Py_uhash_t)14029467366897019727ULL)
#define XXPRIME_5 ((Py_uhash_t)2870177450012600261ULL)
#define XXROTATE(x) ((x << 31) | (x >> 33))
#else
#define XXPRIME_1 ((Py_uhash_t)2654435761UL)
#define XXPRIME_2 ((Py_uhash_t)2246822519UL)
#define XXPRIME_5 ((Py_uhash_t)374761393UL)
#define XXROTATE(x) ((x << 13) | (x >> 19))
#endif

/* hash() of an int: its value modulo 2**61 - 1 (2**31 - 1 on 32-bit builds), sign kept, -1 -> -2 */
#if SIZEOF_VOID_P >= 8
#define HASH_MODULUS (((Py_uhash_t)1 << 61) - 1)
#else
#define HASH_MODULUS (((Py_uhash_t)1 << 31) - 1)
#endif

static inline Py_uhash_t int_hash(Py_hash_t x)
{
    Py_uhash_t u = x < 0 ? (Py_uhash_t)0 - (Py_uhash_t)x : (Py_uhash_t)x;
    Py_hash_t r = (Py_hash_t)(u % HASH_MODULUS);
    if (x < 0)
        r = -r;
    return (Py_uhash_t)(r == -1 ? -2 : r);
}

/* An exact int of one digit (|value| < 2**30, or 2**15 on builds with 15-bit digits): its value,
   read in place (the headers' inline accessors from 3.12, the digit itself before) */
static inline int compact_value(PyObject *op, Py_hash_t *value)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)op))
        return 0;
    *value = (Py_hash_t)PyUnstable_Long_CompactValue((PyLongObject *)op);
    return 1;
#else
    Py_ssize_t size = Py_SIZE(op);
    if (size < -1 || size > 1)
        return 0;
    *value = size * (Py_hash_t)((PyLongObject *)op)->ob_digit[0];
    return 1;
#endif
}

/* tuplehash() after its loop: the length folded in, -1 kept for errors */
static inline Py_hash_t tuple_finish(Py_uhash_t acc, Py_ssize_t len)
{
    acc += (Py_uhash_t)len ^ (XXPRIME_5 ^ 3527539UL);
    return acc == (Py_uhash_t)-1 ? 1546275796 : (Py_hash_t)acc;
}

#define XXSTEP(acc, lane)           \
    do {                            \
        acc += (lane) * XXPRIME_2;  \
        acc = XXROTATE(acc);        \
        acc *= XXPRIME_1;           \
    } while (0)

/* An exact int's hash, read in place (no call, no Python code); 0 when `item` is no exact int */
static inline int int_lane(PyObject *item, hashfunc int_tp_hash, Py_uhash_t *lane)
{
    if (!PyLong_CheckExact(item))
        return 0;
    Py_hash_t value;
    if (compact_value(item, &value))
        *lane = (Py_uhash_t)(value == -1 ? -2 : value);  /* |value| < 2**30: its own hash */
    else
        *lane = (Py_uhash_t)int_tp_hash(item);  /* long_hash: never fails */
    return 1;
}

/* out[k] = hash(tuple(items[k*block:(k+1)*block])) for k < n, when every id is an exact int;
   -1 (no exception set) at the first id that is not. (Hashing 4 blocks side by side was
   slower here: reading the ids' objects, not the multiplies, bounds this loop.) */
static int int_block_hashes(PyObject **items, Py_ssize_t n, Py_ssize_t block, Py_hash_t *out)
{
    hashfunc int_tp_hash = PyLong_Type.tp_hash;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_uhash_t acc = XXPRIME_5, lane;
        PyObject **base = items + k * block;
        for (Py_ssize_t i = 0; i < block; i++) {
            if (!int_lane(base[i], int_tp_hash, &lane))
                return -1;
            XXSTEP(acc, lane);
        }
        out[k] = tuple_finish(acc, block);
    }
    return 0;
}

/* The same for any hashable ids (their __hash__ may run Python code); -1 with an exception set */
static int any_block_hashes(PyObject **items, Py_ssize_t n, Py_ssize_t block, Py_hash_t *out)
{
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_uhash_t acc = XXPRIME_5;
        for (Py_ssize_t i = 0; i < block; i++) {
            Py_hash_t h = PyObject_Hash(items[k * block + i]);
            if (h == -1)
                return -1;
            XXSTEP(acc, (Py_uhash_t)h);
        }
        out[k] = tuple_finish(acc, block);
    }
    return 0;
}

/* The keys, chained: key_k = hash((key_{k-1}, hashes[k])) */
static PyObject *chained(const Py_hash_t *hashes, Py_ssize_t n, Py_hash_t parent)
{
    PyObject *keys = PyList_New(n);
    if (keys == NULL)
        return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_uhash_t acc = XXPRIME_5;
        XXSTEP(acc, int_hash(parent));
        XXSTEP(acc, int_hash(hashes[k]));
        parent = tuple_finish(acc, 2);
        PyObject *key = PyLong_FromSsize_t(parent);
        if (key == NULL) {
            Py_DECREF(keys);
            return NULL;
        }
        PyList_SET_ITEM(keys, k, key);
    }
    return keys;
}

PyDoc_STRVAR(chain_keys_doc,
"chain_keys(prompt, block, max_blocks, parent=0) -> list[int]\n\n"
"The keys of the prompt's first min(len(prompt) // block, max_blocks) full blocks,\n"
"chained from `parent`: the same as prefix_index.py_chain_keys.");

static PyObject *chain_keys(PyObject *self, PyObject *args)
{
    PyObject *prompt;
    Py_ssize_t block, max_blocks, parent_arg = 0;
    if (!PyArg_ParseTuple(args, "Onn|n:chain_keys", &prompt, &block, &max_blocks, &parent_arg))
        return NULL;
    Py_hash_t parent = (Py_hash_t)parent_arg;  /* a key: a Py_hash_t, the size of a Py_ssize_t */
    if (block < 1) {
        PyErr_SetString(PyExc_ValueError, "block must be at least 1");
        return NULL;
    }
    Py_ssize_t len = PyObject_Length(prompt);
    if (len < 0)
        return NULL;
    Py_ssize_t n = len / block < max_blocks ? len / block : max_blocks;
    if (n <= 0)
        return PyList_New(0);
    Py_hash_t *hashes = PyMem_Malloc(n * sizeof(Py_hash_t));
    if (hashes == NULL)
        return PyErr_NoMemory();
    PyObject *keys = NULL;
    /* A list's or tuple's ids are read in place while they are exact ints (reading them runs
       no Python code, so nothing can change the list meanwhile). Other ids' __hash__ might:
       they are hashed from a tuple copy, as the fallback hashes tuple(prompt). */
    if (PyList_CheckExact(prompt) || PyTuple_CheckExact(prompt)) {
        PyObject **items = PyList_CheckExact(prompt) ? ((PyListObject *)prompt)->ob_item : ((PyTupleObject *)prompt)->ob_item;
        if (int_block_hashes(items, n, block, hashes) == 0)
            keys = chained(hashes, n, parent);
        else if (PyTuple_CheckExact(prompt) && any_block_hashes(items, n, block, hashes) == 0)
            keys = chained(hashes, n, parent);
        if (keys != NULL || PyErr_Occurred()) {
            PyMem_Free(hashes);
            return keys;
        }
    }
    PyObject *ids = PySequence_Tuple(prompt);
    if (ids != NULL) {
        if (PyTuple_GET_SIZE(ids) < n * block)
            PyErr_SetString(PyExc_RuntimeError, "prompt changed size while hashed");
        else if (any_block_hashes(((PyTupleObject *)ids)->ob_item, n, block, hashes) == 0)
            keys = chained(hashes, n, parent);
        Py_DECREF(ids);
    }
    PyMem_Free(hashes);
    return keys;
}

static PyMethodDef methods[] = {
    {"chain_keys", chain_keys, METH_VARARGS, chain_keys_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_prefix_keys",
    "The chained block keys of prompts, in C (prefix_index.chain_keys).", -1, methods,
};

PyMODINIT_FUNC PyInit__prefix_keys(void)
{
    return PyModule_Create(&module);
}
