// LMSPD_NO_CONTRACT_ATTR before a function and LMSPD_NO_CONTRACT first in its body: its float
// arithmetic rounded operation by operation, never contracted into fused multiply-adds. GCC's
// C++ default contracts a * b + c where the target has FMA (-march=native), and MLX's kernels,
// which these reproduce bit for bit, round the product first.
#pragma once

#if defined(__clang__)
#define LMSPD_NO_CONTRACT _Pragma("clang fp contract(off)")
#define LMSPD_NO_CONTRACT_ATTR
#else
#define LMSPD_NO_CONTRACT
#define LMSPD_NO_CONTRACT_ATTR __attribute__((optimize("fp-contract=off")))
#endif
