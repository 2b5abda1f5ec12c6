/* A library interpose_calls dlopens (RTLD_LOCAL): its malloc calls come from code loaded after
 * the process started. */
#include <stdlib.h>

void lib_calls(int n) {
    for (int i = 0; i < n; i++) {
        void *volatile p = malloc(7007);
        free(p);
    }
}
