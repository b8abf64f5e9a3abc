/* The playground page (server/playground.html) as bytes in the binary,
 * for GET / (server/playground.h). The Makefile rebuilds this object when
 * the page changes; the assembler finds the page through -I. */
    .section .rodata
    .global playground_html
    .type playground_html, @object
    .balign 16
playground_html:
    .incbin "server/playground.html"
playground_html_end:
    .size playground_html, playground_html_end - playground_html

    .global playground_html_len
    .type playground_html_len, @object
    .balign 8
playground_html_len:
    .quad playground_html_end - playground_html
    .size playground_html_len, 8

    .section .note.GNU-stack, "", @progbits
