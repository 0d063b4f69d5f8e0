#ifndef CHATCORE_CMALLOC_SHIM_H
#define CHATCORE_CMALLOC_SHIM_H
/* What the C library says of its heap: how big a block is (the message cache counts what
   its records take), and how much is in use (tests check that count against it). */
#if defined(__APPLE__)
#include <malloc/malloc.h>
#else
#include <malloc.h>
#endif
#endif
