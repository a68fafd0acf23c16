// Must not compile: index 1 is out of range for a call with one argument after the Scope.
#include <linum/linum.hpp>
using namespace linum;
struct Block {
  Array operator()(Scope&, const Array& x) const { return x; }
};
int main() {
  Tree vars;
  Array x = Array::zeros(Shape{2});
  (void)apply(lift::remat<Block, lift::static_argnums<1>>{}, vars, x);
}
