// Must not compile: lift::static_argnums counts from 0 and refuses negative indices.
#include <linum/linum.hpp>
using namespace linum;
struct Block {
  Array operator()(Scope&, const Array& x) const { return x; }
};
int main() {
  Tree vars;
  Array x = Array::zeros(Shape{2});
  (void)apply(lift::remat<Block, lift::static_argnums<-1>>{}, vars, x);
}
